package chunkstore

// gc's repacking (docs/FORMAT.md section 17.5): the live frames of packs
// that are mostly garbage are copied, byte for byte (sealed ones stay
// sealed: they are bound to their id, not their place), into new packs;
// the table's entries move with them (Marks.Moved), so that the index gc
// writes next lists them there. The new packs are written by a PackWriter
// from above: a pack is written by streamer's segment writer (the stream
// format's header, frames and tail, uploads, exclusive commits), which
// this package sits below.

import (
	"bufio"
	"context"
	"fmt"
	"io"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store"
)

// PackWriter writes frames of chunks a location holds already into new
// packs there, as they are (streamer.PackWriter).
type PackWriter interface {
	// Write writes one DATA frame and says where it lies.
	Write(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (PackID, int64, error)
	// Commit commits the packs written and returns them with their sizes.
	Commit(ctx context.Context) ([]Pack, error)
	// Abort deletes the packs written.
	Abort(ctx context.Context) error
}

// Repack copies the marked frames of the packs names, in the location st,
// through w into new packs, moves the table's entries to them (Moved,
// Committed), and says how many packs it wrote. Each old pack is read
// once, from start to end, a frame at a time. On an error the new packs
// are deleted.
func (m *Marks) Repack(ctx context.Context, st store.Store, names []string, w PackWriter) (int, error) {
	want := map[PackID]bool{}
	for _, name := range names {
		id, _ := ParsePackName(name)
		want[id] = true
	}
	frames := m.Frames(func(p PackID) bool { return want[p] })
	br := bufio.NewReaderSize(nil, 1<<20) // one for every pack: no megabyte of garbage each
	for _, name := range names {
		id, _ := ParsePackName(name)
		if err := readFrames(ctx, st, br, name, frames[id], func(f Frame, fh *manifest.FrameHeader, payload []byte) error {
			pack, pos, err := w.Write(ctx, fh, payload)
			if err == nil {
				m.Moved(f, fh.Hash, Ref{Pack: pack, Pos: pos,
					RawLen: fh.RawLen, Stored: fh.StoredLen, Codec: fh.Codec, Checksum: fh.Checksum})
			}
			return err
		}); err != nil {
			_ = w.Abort(ctx)
			return 0, fmt.Errorf("repack %s/%s: %w", st, name, err)
		}
	}
	packs, err := w.Commit(ctx)
	if err != nil {
		_ = w.Abort(ctx)
		return 0, fmt.Errorf("repack: %w", err)
	}
	m.Committed(packs)
	return len(packs), nil
}

// readFrames reads frames, in offset order, from the pack name through br
// and hands each to put, checked: a DATA frame of the length expected.
func readFrames(ctx context.Context, st store.Store, br *bufio.Reader, name string, frames []Frame, put func(Frame, *manifest.FrameHeader, []byte) error) error {
	r, err := st.Open(ctx, name, 0, -1)
	if err != nil {
		return err
	}
	defer r.Close()
	br.Reset(r)
	var at int64
	var buf []byte
	for _, f := range frames {
		off, n := f.Pos, f.Len
		if off < at {
			return fmt.Errorf("frames at %d and before %d overlap: %w", off, at, errdefs.ErrCorrupt)
		}
		if _, err := br.Discard(int(off - at)); err != nil {
			return fmt.Errorf("offset %d: %w", off, err)
		}
		if cap(buf) < int(n) {
			buf = make([]byte, n)
		}
		buf = buf[:n]
		if _, err := io.ReadFull(br, buf); err != nil {
			return fmt.Errorf("frame at %d: %w", off, err)
		}
		at = off + n
		fh, err := manifest.UnmarshalFrameHeader(buf[:manifest.FrameSize])
		if err != nil || fh.Type != manifest.FrameData || int64(fh.StoredLen) != n-manifest.FrameSize {
			return fmt.Errorf("frame at %d is not the chunk its checkpoints name (%v): %w", off, err, errdefs.ErrCorrupt)
		}
		if err := put(f, &fh, buf[manifest.FrameSize:]); err != nil {
			return err
		}
	}
	return nil
}
