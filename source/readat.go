package source

import (
	"context"
	"fmt"
	"io"
	"sort"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
)

// ReaderAt reads the named file of the archive at any offset, a chunk at
// a time, every chunk checked as Copy checks it: for a reader that wants a
// few bytes here and there of a large file (inspect reading the VRAM
// files' headers). It keeps the last chunk it read; ctx bounds every read.
func (a *ArchiveSource) ReaderAt(ctx context.Context, name string) (io.ReaderAt, int64, error) {
	f, ok := a.man.Lookup(name)
	if !ok {
		return nil, 0, fmt.Errorf("%s: %w", name, errdefs.ErrNotFound)
	}
	return &chunkReader{ctx: ctx, a: a, f: f, at: -1}, f.Size, nil
}

type chunkReader struct {
	ctx context.Context
	a   *ArchiveSource
	f   *manifest.File
	// at is the chunk in buf (-1: none).
	at  int
	buf []byte
}

func (r *chunkReader) ReadAt(p []byte, off int64) (int, error) {
	n := 0
	for n < len(p) {
		o := off + int64(n)
		if o >= r.f.Size {
			return n, io.EOF
		}
		i := sort.Search(len(r.f.Chunks), func(i int) bool {
			c := r.f.Chunks[i]
			return c.Offset+int64(c.RawLen) > o
		})
		if i == len(r.f.Chunks) || r.f.Chunks[i].Offset > o {
			return n, fmt.Errorf("%s: offset %d is in no chunk: %w", r.f.Name, o, errdefs.ErrCorrupt)
		}
		if err := r.load(i); err != nil {
			return n, err
		}
		n += copy(p[n:], r.buf[o-r.f.Chunks[i].Offset:])
	}
	return n, nil
}

// load reads chunk i into buf.
func (r *chunkReader) load(i int) error {
	if r.at == i {
		return nil
	}
	v, err := r.a.fetch(r.ctx, r.f, i)
	if err != nil {
		return err
	}
	defer r.a.drop(v)
	c := r.f.Chunks[i]
	r.buf = append(r.buf[:0], make([]byte, c.RawLen)...)
	at := 0
	for _, b := range v.raw { // a zero chunk has none: zeros
		at += copy(r.buf[at:], b)
	}
	r.at = i
	return nil
}
