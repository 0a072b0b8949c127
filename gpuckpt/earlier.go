package gpuckpt

// A --dedup checkpoint on the fast path copies out and keeps only what
// changed since an earlier checkpoint of the process in the same location
// (vram/earlier.go has the mechanism; docs/PRODUCERS.md, "Blocks an
// earlier checkpoint holds", the design). Here: which checkpoint that
// may be (the library's hints, each opened and checked: a deduplicated
// checkpoint of this location that records this process's block hashes),
// and what keeps it readable until nothing needs it any more: a lock of
// the location's chunk store (gc deletes nothing while another lock
// lives; a gc already running means no earlier checkpoint is used), held
// from the first look until the commit or the undo, whose refill may read
// it after the capture has let its own lock go. Removing the checkpoint
// meanwhile (rm) removes its manifest only, which was read once.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/vram"
)

// DedupTarget is the checkpoint a --dedup checkpoint goes to, and how its
// location is opened.
type DedupTarget struct {
	Dest location.Location
	Open location.Config
}

// earliers are the earlier checkpoints a --dedup checkpoint into t looks
// at, and the lock that keeps them readable.
type earliers struct {
	t      DedupTarget
	parent location.Location
	log    func(string)
	// lock is taken at the first look (closeStore closes its store);
	// gc says a gc held the location then.
	lock       *chunkstore.Lock
	closeStore func()
	gc         []string
	srcs       []source.Source
}

// locKey is the 64-bit name of a location the library keeps its hints
// under.
func locKey(parent location.Location) uint64 {
	h := codec.ContentHash([]byte(fmt.Sprintf("gpucr-stream location %d %s", parent.Kind, parent.Path)))
	return binary.BigEndian.Uint64(h[:8])
}

// dedupFor is the fast path's side of a --dedup checkpoint into t (nil
// where t is none, or no archive).
func (cc *Checkpoint) dedupFor(t *DedupTarget, log func(string)) *vram.Dedup {
	if t == nil || !archived(t.Dest) {
		return nil
	}
	parent, ok := t.Dest.Parent()
	if !ok {
		return nil
	}
	e := &earliers{t: *t, parent: parent, log: log}
	cc.earlier = e
	return &vram.Dedup{Loc: locKey(parent), Name: t.Dest.Name(), Find: e.find, Note: func(s string) { say(log, s) }}
}

// take takes the chunk store's lock, once.
func (e *earliers) take(ctx context.Context) error {
	if e.lock != nil {
		return nil
	}
	st, closeStore, err := location.OpenStore(ctx, e.parent, e.t.Open)
	if err != nil {
		return err
	}
	lock, err := chunkstore.TakeLock(ctx, st, chunkstore.LockCapture)
	if err != nil {
		closeStore()
		return err
	}
	e.lock, e.closeStore, e.gc = lock, closeStore, lock.Others[chunkstore.LockGC]
	return nil
}

// find opens the checkpoint name of the location as an earlier one of
// process pid (vram.Dedup.Find).
func (e *earliers) find(ctx context.Context, pid int, name string) (*vram.Earlier, string, error) {
	loc, ok := e.t.Dest.Sibling(name)
	if !ok {
		return nil, fmt.Sprintf("%q is no checkpoint name", name), nil
	}
	if err := e.take(ctx); err != nil {
		return nil, fmt.Sprintf("the location's chunk store cannot be locked (%v)", err), nil
	}
	if len(e.gc) > 0 {
		return nil, fmt.Sprintf("a gc runs in %s (%s)", e.parent, strings.Join(e.gc, ", ")), nil
	}
	src, err := location.OpenSource(ctx, loc, e.t.Open, source.StreamSourceOptions{})
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, fmt.Sprintf("%s is gone", loc), nil
	}
	if err != nil {
		return nil, fmt.Sprintf("%s: %v", loc, err), nil
	}
	a, i := hashesOf(src, pid)
	if i < 0 {
		src.Close()
		return nil, fmt.Sprintf("%s holds no block hashes of process %d", loc, pid), nil
	}
	m := a.Manifest()
	e.srcs = append(e.srcs, src)
	// It says it is this process's: from here on, what cannot be read
	// fails the checkpoint (before anything is released).
	ea, err := earlierOf(ctx, a, loc.String(), m.CUDA[i])
	if err != nil {
		return nil, "", fmt.Errorf("the earlier checkpoint %s: %w", loc, err)
	}
	return ea, "", nil
}

// hashesOf is src as a deduplicated archive (location.ArchiveOf: through
// location's wrappers) and the index of pid's record with block hashes in
// its manifest (-1: none).
func hashesOf(src source.Source, pid int) (*source.ArchiveSource, int) {
	a := location.ArchiveOf(src)
	if a == nil || !a.Manifest().SharedChunks {
		return nil, -1
	}
	return a, slices.IndexFunc(a.Manifest().CUDA, func(c manifest.CUDAProcess) bool {
		return c.PID == pid && c.Path == manifest.CUDAPathPreload && c.Hashes != "" && len(c.Files) > 0
	})
}

// maxHashesFile bounds a BlockHashes file read: 24 bytes a 4 KiB block of
// 64 GiB pieces a file would be far below it.
const maxHashesFile = 1 << 30

// earlierOf reads the block hashes c records in a, and checks them
// against its VRAM files' sizes.
func earlierOf(ctx context.Context, a *source.ArchiveSource, where string, c manifest.CUDAProcess) (*vram.Earlier, error) {
	r, size, err := a.ReaderAt(ctx, c.Hashes)
	if err != nil {
		return nil, err
	}
	if size > maxHashesFile {
		return nil, fmt.Errorf("%s: %d bytes of block hashes: %w", c.Hashes, size, errdefs.ErrCorrupt)
	}
	b := make([]byte, size)
	if _, err := r.ReadAt(b, 0); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%s: %w", c.Hashes, err)
	}
	h, err := vram.ParseBlockHashes(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", c.Hashes, err)
	}
	var sizes []int64
	var chunks [][]manifest.Chunk
	for _, f := range c.Files {
		st, err := a.Stat(ctx, f)
		if err != nil {
			return nil, err
		}
		sizes = append(sizes, st.Size)
		chunks = append(chunks, st.Chunks)
	}
	if err := h.CheckFiles(sizes); err != nil {
		return nil, fmt.Errorf("%s: %w", c.Hashes, err)
	}
	if a.Manifest().Encryption != nil {
		chunks = nil // keyed ids: the capture names none (streamer.Capture.Knows)
	}
	return &vram.Earlier{Name: where, Hashes: h, Files: c.Files, Chunks: chunks, Open: func(ctx context.Context, name string) (io.ReaderAt, error) {
		r, _, err := a.ReaderAt(ctx, name)
		return r, err
	}}, nil
}

// end lets the earlier checkpoints go: the lock, the sources.
func (e *earliers) end(ctx context.Context) error {
	if e == nil {
		return nil
	}
	for _, s := range e.srcs {
		s.Close()
	}
	e.srcs = nil
	if e.lock != nil {
		e.lock.Release(ctx)
		e.closeStore()
		e.lock = nil
	}
	return nil
}

// openEarlier is how `gpu resume --pid` opens the earlier checkpoint a
// kept copy left blocks out for (its record names it), with the same
// checks as a checkpoint's and open's settings.
func openEarlier(open location.Config) vram.OpenEarlier {
	return func(ctx context.Context, where string, pid int) (*vram.Earlier, func(), error) {
		loc, err := location.Parse(where)
		if err != nil {
			return nil, nil, err
		}
		src, err := location.OpenSource(ctx, loc, open, source.StreamSourceOptions{})
		if err != nil {
			return nil, nil, err
		}
		a, i := hashesOf(src, pid)
		if i < 0 {
			src.Close()
			return nil, nil, fmt.Errorf("%s holds no block hashes of process %d: %w", loc, pid, errdefs.ErrNotFound)
		}
		e, err := earlierOf(ctx, a, loc.String(), a.Manifest().CUDA[i])
		if err != nil {
			src.Close()
			return nil, nil, err
		}
		return e, func() { src.Close() }, nil
	}
}
