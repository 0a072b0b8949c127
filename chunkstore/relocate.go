package chunkstore

// gc repacks packs that are mostly garbage: it copies their live frames,
// byte for byte, into new packs, lists them in the index, and deletes the
// old packs. Manifests are not rewritten (an encrypted one is authenticated
// with a key gc does not have, and a manifest is its checkpoint's commit
// point, written once): a reader finds a chunk whose manifest pack is gone
// through the index, by its id, at the same cost as a capture's lookup.

import (
	"context"
	"errors"
	"fmt"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store"
)

// Packs lists the packs of the location st, by id, with their sizes.
func Packs(ctx context.Context, st store.Store) (map[PackID]int64, error) {
	objs, err := st.List(ctx, PackPrefix)
	if err != nil {
		return nil, fmt.Errorf("list packs of %s: %w", st, err)
	}
	return PacksIn(objs), nil
}

// PacksIn are the packs in objs, a listing of a location, by id, with
// their sizes.
func PacksIn(objs []store.ObjectInfo) map[PackID]int64 {
	out := make(map[PackID]int64)
	for _, o := range objs {
		if id, ok := ParsePackName(o.Name); ok {
			out[id] = o.Size
		}
	}
	return out
}

// missing says some pack m names is not in present.
func missing(m *manifest.Manifest, present map[PackID]int64) bool {
	for _, s := range m.Segments {
		if id, ok := ParsePackName(s.Name); !ok || present[id] != s.Size {
			return true
		}
	}
	return false
}

// Relocate points the chunks of m (format 4) that lie in packs not in
// present at where the index t finds their ids, and rewrites m.Segments to
// the packs its chunks then lie in. A chunk whose pack is gone and whose id
// the index lacks is lost: an error naming it.
func Relocate(m *manifest.Manifest, t *Table, present map[PackID]int64) error {
	var segs []manifest.Segment
	at := map[PackID]int{}
	use := func(p PackID, size int64) int {
		i, ok := at[p]
		if !ok {
			i = len(segs)
			at[p] = i
			segs = append(segs, manifest.Segment{Name: p.Name(), Size: size})
		}
		return i
	}
	for f, c := range storedChunks(m) {
		s := m.Segments[c.Segment]
		if id, ok := ParsePackName(s.Name); ok && present[id] == s.Size {
			c.Segment = use(id, s.Size)
			continue
		}
		r, ok := t.Lookup(c.Hash)
		size, there := present[r.Pack]
		if !ok || !there {
			return fmt.Errorf("file %s: chunk %s at offset %d: its pack %s is gone and the index finds it in no pack there: %w",
				manifest.PrintableName(f.Name), c.Hash, c.Offset, manifest.PrintableName(s.Name), errdefs.ErrNotFound)
		}
		if r.RawLen != c.RawLen || r.Stored != c.Stored || r.Codec != c.Codec || r.Checksum != c.Checksum {
			return fmt.Errorf("file %s: chunk %s at offset %d: the index lists it with other lengths, codec or CRC: %w",
				manifest.PrintableName(f.Name), c.Hash, c.Offset, errdefs.ErrCorrupt)
		}
		c.Segment, c.Pos = use(r.Pack, size), r.Pos
	}
	m.Segments = segs
	return nil
}

// FindRepacked points the chunks of m, the manifest of the checkpoint ckpt,
// where a reader finds them (docs/FORMAT.md section 17.4, repacked chunks):
// one listing of the packs of ckpt's location, and, only where a pack m
// names is gone (gc repacked it), the index loaded and Relocate. A plain
// checkpoint, or one with no location above it (the reader says why it
// cannot be read), is left as it is.
func FindRepacked(ctx context.Context, ckpt store.Store, m *manifest.Manifest) error {
	if !m.SharedChunks || len(m.Segments) == 0 {
		return nil
	}
	loc, _, ok := store.Parent(ckpt)
	if !ok {
		return nil
	}
	present, err := Packs(ctx, loc)
	if err != nil {
		return err
	}
	if !missing(m, present) {
		return nil
	}
	t, err := Load(ctx, loc)
	if err != nil {
		return err
	}
	if err := Relocate(m, t, present); err != nil {
		if bad := t.Skipped(); len(bad) > 0 && errors.Is(err, errdefs.ErrNotFound) {
			// The chunk may be in a pack only that object described.
			return fmt.Errorf("%s: %w; %d index object(s) of %s could not be read (%v): `gpucr-stream check --repair-index %s` rebuilds the index from the packs",
				ckpt, err, len(bad), loc, bad[0].Err, loc)
		}
		return fmt.Errorf("%s: %w", ckpt, err)
	}
	return nil
}
