package criusock

// CRIU's small images, read whole: two magics, then entries, each a 4-byte
// little-endian length and a protobuf message (criu/protobuf.c). remap.go,
// timewait.go and sparse.go rewrite or read them on the way to CRIU.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/source"
)

const imgCommonMagic = 0x54564319 // criu/include/magic.h

// imageEntries walks the entries of a CRIU image after its two magics:
// each a 4-byte little-endian length and that many bytes.
func imageEntries(img []byte, magic uint32, fn func(raw []byte, off int) error) error {
	if len(img) < 8 || binary.LittleEndian.Uint32(img) != imgCommonMagic || binary.LittleEndian.Uint32(img[4:]) != magic {
		return fmt.Errorf("bad magic at offset 0: %w", errdefs.ErrCorrupt)
	}
	for off := 8; off < len(img); {
		if len(img)-off < 4 {
			return fmt.Errorf("entry length truncated at offset %d: %w", off, errdefs.ErrCorrupt)
		}
		n := int(binary.LittleEndian.Uint32(img[off:]))
		if n > len(img)-off-4 {
			return fmt.Errorf("entry of %d bytes at offset %d runs past the end (%d bytes): %w", n, off, len(img), errdefs.ErrCorrupt)
		}
		if err := fn(img[off+4:off+4+n], off); err != nil {
			return err
		}
		off += 4 + n
	}
	return nil
}

// readImage reads a small image whole, at most limit bytes of it.
func readImage(ctx context.Context, src source.Source, name string, limit int64) ([]byte, error) {
	var buf bytes.Buffer
	if _, err := src.Copy(ctx, name, &limitWriter{&buf, limit, limit}); err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	return buf.Bytes(), nil
}

// errTooLarge is an image larger than what is read of it.
var errTooLarge = errors.New("image too large")

// limitWriter fails writes past limit bytes (n of them left).
type limitWriter struct {
	w        io.Writer
	n, limit int64
}

func (l *limitWriter) Write(b []byte) (int, error) {
	if int64(len(b)) > l.n {
		return 0, fmt.Errorf("%w: larger than %d bytes", errTooLarge, l.limit)
	}
	l.n -= int64(len(b))
	return l.w.Write(b)
}
