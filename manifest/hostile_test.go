package manifest

import (
	"errors"
	"math"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
)

// Every cut of a stream is corrupt input (exit 3), including cuts inside
// the 32-byte stream header and inside a 64-byte frame header.
func TestReaderEveryCutIsCorrupt(t *testing.T) {
	ts := writeStream(t, Header{}, []frameSpec{file(0, "a.img"), data(0, 0, []byte("abcdef")), fileEnd(0, 6, 1)}, []byte("{}"))
	for n := range len(ts.b) {
		_, _, err := readAll(ts.b[:n], "cut")
		if !errors.Is(err, errdefs.ErrCorrupt) {
			t.Errorf("cut at %d of %d bytes: %v, want ErrCorrupt", n, len(ts.b), err)
		}
	}
}

// A segment of negative size wraps the bound check: size -2^63 let any
// chunk position pass.
func TestValidateNegativeSegmentSize(t *testing.T) {
	for _, size := range []int64{math.MinInt64, -1} {
		m := goodManifest()
		m.Segments[1].Size = size
		m.Files[0].Chunks[2].Pos = math.MaxInt64 / 2
		if err := m.Validate(); err == nil {
			t.Errorf("segment size %d accepted", size)
		}
		b, err := m.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Parse(b); !errors.Is(err, errdefs.ErrCorrupt) {
			t.Errorf("Parse with segment size %d: %v, want ErrCorrupt", size, err)
		}
	}
}
