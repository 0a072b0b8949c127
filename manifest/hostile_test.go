package manifest

import (
	"errors"
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

