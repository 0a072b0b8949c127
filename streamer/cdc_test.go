package streamer

import (
	"bytes"
	"fmt"
	"io"
	"slices"
	"testing"
	"testing/iotest"

	"github.com/gpucr/gpucr-stream/codec"
)

// cuts returns the chunk lengths the cutter makes of data, checking that
// each chunk's sums are those of its bytes (its CRC-32C is joined from
// its pages').
func cuts(t *testing.T, data []byte, chunkSize int) []int {
	t.Helper()
	return cutsFrom(t, bytes.NewReader(data), data, chunkSize)
}

// eachCut runs fn on every chunk a cutter of chunkSize cuts from r, in
// order, with its sums.
func eachCut(t *testing.T, r io.Reader, chunkSize int, fn func(chunk []byte, s chunkSums)) {
	t.Helper()
	c := newCutter(r, chunkSize, nil)
	buf := make([]byte, chunkSize)
	for {
		var s chunkSums
		n, err := c.next(buf, &s)
		if err != nil && err != io.EOF {
			t.Fatal(err)
		}
		if n > 0 {
			fn(buf[:n], s)
		}
		if err == io.EOF {
			return
		}
	}
}

// cutsFrom is cuts of data read from r.
func cutsFrom(t *testing.T, r io.Reader, data []byte, chunkSize int) []int {
	t.Helper()
	var out []int
	off := 0
	eachCut(t, r, chunkSize, func(got []byte, s chunkSums) {
		n := len(got)
		chunk := data[off : off+n]
		if !bytes.Equal(got, chunk) {
			t.Fatalf("chunk at %d does not hold the file's bytes", off)
		}
		if s.zero != codec.IsZero(chunk) || (!s.zero && s.crc != codec.Checksum(chunk)) {
			t.Fatalf("chunk at %d: sums %+v wrong", off, s)
		}
		out = append(out, n)
		off += n
	})
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
			// Reads of any size, not on pages (a pipe's), cut the same.
			odd := cutsFrom(t, iotest.HalfReader(&pieceReader{b: tc.data, max: 5000}), tc.data, size)
			if !slices.Equal(odd, ls) {
				t.Errorf("read in odd pieces: %d chunks %v, from whole reads %d %v", len(odd), odd, len(ls), ls)
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

// TestCutterStable pins what the cutter makes of fixed inputs: every
// chunk's length, zero flag, CRC-32C and id, folded into one BLAKE3
// digest. Chunk boundaries and sums are part of what a location stores
// (format 4): a change here makes every chunk of existing locations new.
// The digest was taken from the cutter of c748e21.
func TestCutterStable(t *testing.T) {
	img := benchImage(16)
	zeros := make([]byte, 3<<20)
	mixed := append(append(append([]byte(nil), img[:3<<20]...), zeros...), img[3<<20:]...)
	var log []byte
	chunks := 0
	for _, tc := range []struct {
		data      []byte
		chunkSize int
	}{{img, 4 << 20}, {img, 1 << 20}, {mixed, 4 << 20}, {mixed[5000:], 1 << 20}, {img[:5<<20+123], 256 << 10}, {zeros, 4 << 20}} {
		eachCut(t, bytes.NewReader(tc.data), tc.chunkSize, func(chunk []byte, s chunkSums) {
			crc := s.crc
			if s.zero {
				crc = 0 // not computed: zero chunks have a fixed sum
			}
			log = fmt.Appendf(log, "%d %t %08x %x\n", len(chunk), s.zero, crc, codec.ContentHash(chunk))
			chunks++
		})
	}
	t.Logf("%d chunks", chunks)
	const want = "09bbce1562578e06c9f8e4725ee6ecf96ac1ccd1f1c75bd57bb52e5a33dd7c7d"
	if got := fmt.Sprintf("%x", codec.ContentHash(log)); got != want {
		t.Errorf("the cutter's chunks changed: digest %s, want %s", got, want)
	}
}
