package catalog

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
)

// CopyResult is what Copy did.
type CopyResult struct {
	Source      string `json:"source"`
	Destination string `json:"destination"`
	ID          string `json:"id"`
	Segments    int    `json:"segments"`
	// Kept are segments already in the destination with the right size,
	// from a copy that was cut short; they are verified like the others.
	Kept  int   `json:"kept"`
	Bytes int64 `json:"bytes"` // copied now
	// Verified is the raw bytes checked in the destination.
	Verified int64 `json:"verified_bytes"`
	// Already is set when the destination held this checkpoint already.
	Already bool `json:"already,omitempty"`
	// BadIndex are the destination's index objects that could not be
	// read (corrupt or truncated), each with what is wrong: the chunks
	// they list were indexed again.
	BadIndex []Problem `json:"bad_index,omitempty"`
}

// ErrOtherCheckpoint means the destination holds a different checkpoint.
var ErrOtherCheckpoint = errors.New("the destination holds another checkpoint")

// Copy copies the checkpoint in src to dst, between any two stores: the
// segments first (one already in dst with the size the manifest gives is
// kept, so a copy that was cut short resumes), then every chunk is read
// back from dst and checked against the manifest, and of a plain archive
// every other byte of the segments too (source.VerifyArchive,
// CheckSegments: frames no chunk's read covers), and only then the
// manifest is written, byte for byte: dst holds the complete checkpoint or
// none. progress, if not nil, counts the bytes copied (RawBytes).
func Copy(ctx context.Context, src, dst store.Store, opts pipeline.Options, progress *pipeline.Counters) (*CopyResult, error) {
	res := &CopyResult{Source: src.String(), Destination: dst.String()}
	// Chunks are read back from dst: the check that matters is of what dst
	// holds. An encrypted archive is copied as it is, and checked with
	// opts.Key.
	a, raw, err := source.OpenArchiveAt(ctx, src, dst, pipeline.Options{Workers: opts.Workers, MemoryLimit: opts.MemoryLimit,
		VerifyHashes: true, Key: opts.Key})
	if err != nil {
		return nil, err
	}
	defer a.Close()
	m := a.Manifest()
	res.ID, res.Segments = m.ID, len(m.Segments)
	if theirs, err := source.ReadManifest(ctx, dst); err == nil {
		if theirs.ID == m.ID && theirs.Checksum == m.Checksum {
			res.Already = true
			return res, nil
		}
		return nil, fmt.Errorf("%s: %w (id %s, not %s): remove it first (gpucr-stream rm)", dst, ErrOtherCheckpoint, theirs.ID, m.ID)
	} else if !errors.Is(err, errdefs.ErrNotFound) {
		return nil, err
	}
	if progress == nil {
		progress = &pipeline.Counters{}
	}
	from, to := src, dst
	var lock *store.Lock
	var gcHeld []string // gc locks held at dst's location when cp took its own
	if m.SharedChunks {
		// A deduplicated checkpoint's packs go from location to location,
		// those the destination holds already (same name: packs are
		// immutable) staying; a capture lock keeps gc there from taking
		// them before the manifest names them.
		var okSrc, okDst bool
		from, _, okSrc = store.Parent(src)
		to, _, okDst = store.Parent(dst)
		if !okSrc || !okDst {
			return nil, fmt.Errorf("cp %s to %s: a deduplicated checkpoint goes from a location to a location: %w", src, dst, errdefs.ErrUsage)
		}
		cl, err := chunkstore.TakeLock(ctx, to, chunkstore.LockCapture)
		if err != nil {
			return nil, err
		}
		defer cl.Release(ctx)
		lock, gcHeld = cl.Lock, cl.Others[chunkstore.LockGC]
	} else {
		// A lock beside the segments keeps gc from them until the
		// manifest names them, as a capture's does.
		if lock, err = store.TakeLock(ctx, dst, manifest.CaptureLockName(rand.Uint64()), "cp"); err != nil {
			return nil, err
		}
		defer lock.Release(ctx)
	}
	if err := copySegments(ctx, from, to, m, gcHeld, progress, res); err != nil {
		return res, err
	}
	if m.SharedChunks {
		bad, err := chunkstore.IndexCheckpoint(ctx, to, m)
		for _, b := range bad {
			res.BadIndex = append(res.BadIndex, Problem{Name: b.Name, Error: b.Err.Error()})
		}
		if err != nil {
			return res, err
		}
	}
	rep, err := source.VerifyArchive(ctx, a)
	if err != nil {
		return res, fmt.Errorf("verify the copy in %s: %w", dst, err)
	}
	res.Verified = rep.Bytes
	// What was verified stays: no gc took the copy for dead meanwhile,
	// and none will until the lock goes.
	if err := lock.Confirm(ctx); err != nil {
		return res, fmt.Errorf("%s: refusing to commit the copy: %w", dst, err)
	}
	w, err := dst.Create(ctx, manifest.ManifestName)
	if err != nil {
		return res, err
	}
	if _, err := w.Write(raw); err != nil {
		w.Abort(ctx)
		return res, fmt.Errorf("write %s/%s: %w", dst, manifest.ManifestName, err)
	}
	// Only where no manifest is: another cp or capture may have committed
	// one since the check above.
	if err := w.CommitNew(ctx); err != nil {
		if errors.Is(err, errdefs.ErrExists) {
			return res, lostTo(ctx, dst, m, res)
		}
		return res, fmt.Errorf("commit %s/%s: %w", dst, manifest.ManifestName, err)
	}
	return res, nil
}

// copySegments copies m's segments from from to to, keeping those to
// holds already at their size (a copy cut short resumes), unless gcHeld
// names gc locks held at to when cp took its own: such a gc may have read
// the manifests there before this copy's is written, and delete a pack
// as unreferenced; like a capture that sees a gc lock, cp then shares
// nothing. It counts in res.
func copySegments(ctx context.Context, from, to store.Store, m *manifest.Manifest, gcHeld []string, progress *pipeline.Counters, res *CopyResult) error {
	for _, seg := range m.Segments {
		if info, err := to.Stat(ctx, seg.Name); err == nil && info.Size == seg.Size {
			if len(gcHeld) > 0 {
				return fmt.Errorf("a gc holds %s (%v) and may remove %s, which the copy would share: run cp again once it ends",
					to, gcHeld, seg.Name)
			}
			res.Kept++
			continue
		}
		n, err := copyObject(ctx, from, to, seg, progress)
		res.Bytes += n
		if err != nil {
			return err
		}
	}
	return nil
}

// lostTo is Copy's end when another writer committed a manifest in dst
// first: if it is this checkpoint, the copy is done; else the segments
// copied that the other checkpoint does not name are removed (where its
// manifest cannot be read, none: which are its own is unknown).
func lostTo(ctx context.Context, dst store.Store, m *manifest.Manifest, res *CopyResult) error {
	theirs, err := source.ReadManifest(ctx, dst)
	if err != nil {
		return fmt.Errorf("%s: %w meanwhile (its manifest: %v); this copy's segments are left for gc: %w", dst, ErrOtherCheckpoint, err, errdefs.ErrExists)
	}
	if theirs.ID == m.ID && theirs.Checksum == m.Checksum {
		res.Already = true
		return nil
	}
	keep := map[string]bool{}
	for _, s := range theirs.Segments {
		keep[s.Name] = true
	}
	var names []string
	for _, s := range m.Segments {
		if !keep[s.Name] {
			names = append(names, s.Name)
		}
	}
	if _, err := removeObjects(ctx, dst, names); err != nil {
		return fmt.Errorf("%s: %w meanwhile (id %s); removing this copy's segments: %v: %w", dst, ErrOtherCheckpoint, theirs.ID, err, errdefs.ErrExists)
	}
	return fmt.Errorf("%s: %w meanwhile (id %s, not %s); this copy's segments were removed: %w", dst, ErrOtherCheckpoint, theirs.ID, m.ID, errdefs.ErrExists)
}

// copyObject copies one segment, checking its size before it commits, and
// commits it only where no object of its name is.
func copyObject(ctx context.Context, src, dst store.Store, seg manifest.Segment, progress *pipeline.Counters) (int64, error) {
	r, err := src.Open(ctx, seg.Name, 0, -1)
	if err != nil {
		return 0, err
	}
	defer r.Close()
	w, err := dst.Create(ctx, seg.Name)
	if err != nil {
		return 0, err
	}
	n, err := io.Copy(w, &countingReader{r, progress})
	if err == nil && n != seg.Size {
		err = fmt.Errorf("%s/%s: %d bytes, the manifest says %d: %w", src, seg.Name, n, seg.Size, errdefs.ErrCorrupt)
	}
	if err != nil {
		w.Abort(ctx)
		return n, fmt.Errorf("copy %s: %w", seg.Name, err)
	}
	// Never over another object: a segment of that name that appeared
	// since the Stat in Copy is another writer's (a copy of an archive
	// with the old segment names, the same in every capture).
	if err := w.CommitNew(ctx); err != nil {
		if errors.Is(err, errdefs.ErrExists) {
			return n, fmt.Errorf("copy %s: %s holds another object of that name (another capture's or copy's; `gpucr-stream gc` removes leftovers): %w", seg.Name, dst, err)
		}
		return n, fmt.Errorf("copy %s: %w", seg.Name, err)
	}
	return n, nil
}

// countingReader counts what it reads, for a progress display.
type countingReader struct {
	r io.Reader
	c *pipeline.Counters
}

func (c *countingReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.c.RawBytes.Add(int64(n))
	return n, err
}
