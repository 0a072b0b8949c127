package source

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
)

// entry lists the file's chunks too, as decoded: Codec says only which
// are zero (codec.Zero; the others codec.None), which is what a sparse
// serve of a pages image needs (criusock/sparse.go).
func (f *streamFile) entry() manifest.File {
	m := manifest.File{Name: f.name, Size: f.size, Digest: f.digest, External: f.external, Carried: f.carried}
	if len(f.chunks) > 0 {
		m.Chunks = make([]manifest.Chunk, len(f.chunks))
		for i, c := range f.chunks {
			m.Chunks[i] = manifest.Chunk{Offset: c.off, RawLen: uint32(c.n), Checksum: c.crc, Hash: c.hash, Codec: uint8(codec.None)}
			if c.zero {
				m.Chunks[i].Codec = uint8(codec.Zero)
			}
		}
		// A file still arriving has them in the order they came.
		sort.Slice(m.Chunks, func(i, j int) bool { return m.Chunks[i].Offset < m.Chunks[j].Offset })
	}
	return m
}

// Stat implements Source. With ServeEarly, a file still arriving (see
// arrivedLocked) is listed with the chunks in so far: those sent ahead of
// its end, such as a page image's zero chunks.
func (s *StreamSource) Stat(ctx context.Context, name string) (manifest.File, error) {
	f, err := s.file(ctx, name, true, false)
	if err != nil {
		return manifest.File{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return f.entry(), nil
}

// file waits until the named file is complete (or the stream ended) and
// returns it; with arriving and ServeEarly, also a file still arriving
// (arrivedLocked), the latest opened of that name. With copying, its
// memory is kept for the caller until it calls copyEnd.
func (s *StreamSource) file(ctx context.Context, name string, arriving, copying bool) (*streamFile, error) {
	var f *streamFile
	err := s.wait(ctx, func() bool {
		f = s.complete[name]
		if f == nil && s.early != nil {
			arrived, pending := s.pendingLocked(name)
			if arriving {
				f = arrived
			}
			if !pending && s.early.lateShards == s.shards {
				return true // announced nowhere, and no more files come
			}
		}
		ready := (f != nil && s.early != nil) || s.ended
		if ready && f != nil && copying {
			f.copies++
		}
		return ready
	})
	if err != nil {
		return nil, err
	}
	if f == nil {
		return nil, fmt.Errorf("%s: %w", name, errdefs.ErrNotFound)
	}
	return f, nil
}

// Files implements Source.
func (s *StreamSource) Files(ctx context.Context) ([]manifest.File, error) {
	if err := s.Wait(ctx); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]manifest.File, 0, len(s.complete))
	for _, f := range s.complete {
		out = append(out, f.entry())
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// Copy implements Source. With ServeEarly, a file still arriving is
// copied as it arrives (copyArriving).
func (s *StreamSource) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	f, err := s.file(ctx, name, true, true)
	if err != nil {
		return 0, err
	}
	defer s.copyEnd(f)
	if s.discard {
		return 0, fmt.Errorf("copy %s: stream source keeps no data", name)
	}
	cw := newChunkWriter(w)
	var buf []byte
	s.mu.Lock()
	done := s.doneIDs[f.id]
	s.mu.Unlock()
	var next int64
	if !done {
		s.logArriving(f)
		if next, err = s.copyArriving(ctx, f, cw, w, &buf); err != nil {
			return next, fmt.Errorf("copy %s at offset %d: %w", name, next, err)
		}
	}
	s.mu.Lock()
	chunks := f.chunks
	s.mu.Unlock()
	written := next
	for _, c := range chunks {
		if c.off < next {
			continue // copied as it arrived
		}
		if err := ctx.Err(); err != nil {
			return written, err
		}
		if err := copyChunk(cw, w, c, &buf); err != nil {
			return written, fmt.Errorf("copy %s at offset %d: %w", name, c.off, err)
		}
		written += c.n
	}
	return written, nil
}

// copyChunk writes one chunk to w (through cw).
func copyChunk(cw chunkWriter, w io.Writer, c chunkRec, buf *[]byte) error {
	switch {
	case c.zero:
		return cw.zeros(c.n)
	case c.page != nil || c.borrowed:
		// Never written after decoding, so it may be spliced; the mapping
		// lasts until Close, the pipe's references beyond.
		_, err := cw.write(c.mem)
		return err
	case c.mem != nil:
		_, err := w.Write(c.mem)
		return err
	default:
		if int64(cap(*buf)) < c.n && cw.pipe == nil {
			*buf = make([]byte, c.n)
		}
		return cw.fromFile(c.fd, c.foff, c.n, *buf)
	}
}

// CopyToFile writes the named file into f, a regular file of no data,
// through a shared mapping of it on several goroutines: writes to one file
// are serialized by its inode's lock (a lazy restore's pages image, 4 GiB
// written by Copy, took 1.1 s of its downtime on 16 cores), the faults of a
// mapping are not. Zero chunks are left as holes.
func (s *StreamSource) CopyToFile(ctx context.Context, name string, f *os.File) (int64, error) {
	sf, err := s.file(ctx, name, false, true)
	if err != nil {
		return 0, err
	}
	defer s.copyEnd(sf)
	if s.discard {
		return 0, fmt.Errorf("copy %s: stream source keeps no data", name)
	}
	s.mu.Lock()
	chunks, size := sf.chunks, sf.size
	s.mu.Unlock()
	if err := f.Truncate(size); err != nil || size == 0 {
		return 0, err
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return 0, fmt.Errorf("copy %s: map the file: %w", name, err)
	}
	defer unix.Munmap(m)
	var next atomic.Int64
	workers := min(runtime.GOMAXPROCS(0), 8)
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := next.Add(1) - 1; i < int64(len(chunks)); i = next.Add(1) - 1 {
				if errs[w] = mapChunk(ctx, name, m, chunks[i]); errs[w] != nil {
					return
				}
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	return size, nil
}

// mapChunk writes c, a chunk of the named file, into m, a mapping of the
// whole file: a zero chunk is left a hole.
func mapChunk(ctx context.Context, name string, m []byte, c chunkRec) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if c.off < 0 || c.off+c.n > int64(len(m)) {
		return fmt.Errorf("copy %s: chunk at offset %d of %d bytes beyond the file's %d: %w", name, c.off, c.n, len(m), errdefs.ErrCorrupt)
	}
	dst := m[c.off : c.off+c.n]
	switch {
	case c.zero: // a hole
	case c.mem != nil:
		copy(dst, c.mem)
	default:
		if _, err := c.fd.ReadAt(dst, c.foff); err != nil {
			return fmt.Errorf("copy %s at offset %d: %w", name, c.off, err)
		}
	}
	return nil
}
