package streamer

import (
	"bytes"
	"io"
	"testing"

	"github.com/gpucr/gpucr-stream/codec"
)

// cuts returns the chunk lengths the cutter makes of data, checking that
// each chunk's sums are those of its bytes.
func cuts(t *testing.T, data []byte, chunkSize int) []int {
	t.Helper()
	c := newCutter(bytes.NewReader(data), chunkSize, nil)
	buf := make([]byte, chunkSize)
	var out []int
	off := 0
	for {
		var s chunkSums
		n, err := c.next(buf, &s)
		if err != nil && err != io.EOF {
			t.Fatal(err)
		}
		if n > 0 {
			chunk := data[off : off+n]
			if !bytes.Equal(buf[:n], chunk) {
				t.Fatalf("chunk at %d does not hold the file's bytes", off)
			}
			if s.zero != codec.IsZero(chunk) || (!s.zero && s.crc != codec.Checksum(chunk)) {
				t.Fatalf("chunk at %d: sums %+v wrong", off, s)
			}
			out = append(out, n)
			off += n
		}
		if err == io.EOF {
			break
		}
	}
	if off != len(data) {
		t.Fatalf("chunks cover %d of %d bytes", off, len(data))
	}
	return out
}

func TestCutter(t *testing.T) {
	const size = 1 << 20
	minChunk, _ := cdcParams(size)
	img := benchImage(16) // noise, zero and text pages in turn
	zeros := make([]byte, 4<<20)
	mixed := append(append(append([]byte(nil), img[:3<<20]...), zeros...), img[3<<20:]...)
	for _, tc := range []struct {
		name string
		data []byte
	}{{"image", img}, {"zero run", mixed}, {"odd tail", img[:5<<20+123]}, {"all zero", zeros}} {
		t.Run(tc.name, func(t *testing.T) {
			ls := cuts(t, tc.data, size)
			for i, n := range ls {
				if n > size || (n < minChunk && i != len(ls)-1) {
					t.Fatalf("chunk %d of %d bytes, want %d..%d", i, n, minChunk, size)
				}
			}
		})
	}
	// The zero run becomes zero chunks, but for what the data chunk before
	// it takes (up to a chunk).
	off, zeroBytes := 0, 0
	for _, n := range cuts(t, mixed, size) {
		if codec.IsZero(mixed[off : off+n]) {
			zeroBytes += n
		}
		off += n
	}
	if zeroBytes < len(zeros)-size-cdcPage {
		t.Errorf("%d of a %d-byte zero run in zero chunks", zeroBytes, len(zeros))
	}
	// A page inserted near the start: the cuts after it fall as before.
	shifted := append(append(append([]byte(nil), img[:8192]...), bytes.Repeat([]byte{7}, cdcPage)...), img[8192:]...)
	before := map[[32]byte]bool{}
	off = 0
	for _, n := range cuts(t, img, size) {
		before[codec.ContentHash(img[off:off+n])] = true
		off += n
	}
	off, same := 0, 0
	for _, n := range cuts(t, shifted, size) {
		if before[codec.ContentHash(shifted[off:off+n])] {
			same += n
		}
		off += n
	}
	if float64(same) < 0.9*float64(len(img)) {
		t.Errorf("after a page inserted at 8 KiB, %d of %d bytes are in chunks seen before", same, len(img))
	}
}
