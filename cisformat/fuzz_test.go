package cisformat

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
)

// FuzzReader: any bytes, in one or two shards, either decode cleanly (and
// then every byte was accounted for) or fail with ErrCorrupt; never a
// panic, a hang, or an allocation the input did not pay for.
func FuzzReader(f *testing.F) {
	var s []byte
	s = AppendMarker(s, Marker{Seq: 0, Kind: Filename, Name: "pages-1.img"})
	s = AppendMarker(s, Marker{Seq: 1, Kind: FileData, Size: 4})
	s = append(s, 1, 2, 3, 4)
	s = AppendMarker(s, Marker{Seq: 2, Kind: Filename, Name: "pagemap-1.img"})
	s = AppendMarker(s, Marker{Seq: 3, Kind: FileData, Size: 2})
	s = append(s, 5, 6)
	s = AppendMarker(s, Marker{Seq: 4, Kind: FileEOF})
	s = AppendMarker(s, Marker{Seq: 5, Kind: Filename, Name: "pages-1.img"})
	s = AppendMarker(s, Marker{Seq: 6, Kind: FileEOF})
	s = AppendMarker(s, Marker{Seq: 7, Kind: ImageEOF})
	f.Add(s, uint16(0))
	f.Add(s, uint16(30))
	if b, err := os.ReadFile("testdata/stream.img"); err == nil {
		f.Add(b[:2048], uint16(0))
	}
	f.Fuzz(func(t *testing.T, b []byte, split uint16) {
		shards := []io.Reader{bytes.NewReader(b)}
		names := []string{"s0"}
		if split > 0 && len(b) > 0 {
			k := int(split) % len(b)
			shards = []io.Reader{bytes.NewReader(b[:k]), bytes.NewReader(b[k:])}
			names = []string{"s0", "s1"}
		}
		rd := NewReader(context.Background(), shards, names)
		defer rd.Close()
		var announced, read int64
		for {
			ev, err := rd.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				if !errors.Is(err, errdefs.ErrCorrupt) {
					t.Fatalf("error without ErrCorrupt: %v", err)
				}
				return
			}
			if ev.Kind == Data {
				announced += ev.Size
				n, err := io.Copy(io.Discard, rd)
				read += n
				if err != nil && !errors.Is(err, errdefs.ErrCorrupt) {
					t.Fatalf("data error without ErrCorrupt: %v", err)
				}
			}
		}
		if announced != read {
			t.Fatalf("clean end but %d of %d data bytes read", read, announced)
		}
		var total int64
		for _, st := range rd.Stats() {
			total += st.Size
		}
		if total != int64(len(b)) {
			t.Fatalf("clean end after %d of %d bytes", total, len(b))
		}
	})
}

// FuzzParseMarker: whatever parses re-encodes to a marker that parses the
// same.
func FuzzParseMarker(f *testing.F) {
	f.Add([]byte{0x08, 0x01, 0x18, 0x45})
	f.Add([]byte{0x12, 0x03, 'a', 'b', 'c'})
	f.Add([]byte{0x08, 0x07, 0x28, 0x01})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := ParseMarker(b)
		if err != nil {
			if !errors.Is(err, errdefs.ErrCorrupt) {
				t.Fatalf("error without ErrCorrupt: %v", err)
			}
			return
		}
		enc := AppendMarker(nil, m)
		m2, err := ParseMarker(enc[4:])
		if err != nil || m2 != m {
			t.Fatalf("%+v re-encoded as %x parses as %+v, %v", m, enc, m2, err)
		}
	})
}
