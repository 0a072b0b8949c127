package chunkstore

// A capture's side of the chunk store (docs/FORMAT.md section 17.4,
// writing): under a capture lock, the index loaded once; each chunk looked
// up by its id, a known one referenced where the index says, a new one
// remembered once it is in a new pack, so that a repeat is referenced too;
// at the end one index object for the chunks added, and the manifest's
// list of the packs it references. Writing the packs themselves, proving
// them there and committing the manifest is streamer's DedupOutput (a
// pack is written by its segment writer, which sits above this package).

import (
	"context"
	"fmt"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store"
)

// Writer adds one capture's chunks to the chunk store of a location.
// Knows is safe from any goroutine; the rest, one goroutine at a time.
type Writer struct {
	// Lock is the capture lock it holds until Release.
	Lock *Lock

	loc       store.Store
	table     *Table
	segOf     map[PackID]int // pack -> index in segs
	segs      []PackID       // the packs the manifest references, in order
	added     []Chunk
	newStored int64
	index     string // the index object written, once it is
}

// NewWriter takes a capture lock in the location loc and loads its index,
// once; while a gc holds the location it loads none, so that the capture
// references only packs it writes itself (lock.go).
func NewWriter(ctx context.Context, loc store.Store) (*Writer, error) {
	lock, err := TakeLock(ctx, loc, LockCapture)
	if err != nil {
		return nil, err
	}
	w := &Writer{Lock: lock, loc: loc, table: NewTable(), segOf: map[PackID]int{}}
	// While a gc holds the location, share nothing: gc may delete any
	// pack the index lists.
	if len(lock.Others[LockGC]) == 0 {
		if w.table, err = Load(ctx, loc); err != nil {
			lock.Release(ctx)
			return nil, err
		}
	}
	return w, nil
}

// Knows says the location holds the chunk id already: a capture need not
// encode it.
func (w *Writer) Knows(id [32]byte) bool { return w.table.Has(id) }

// Lookup is where the location holds the chunk id, of rawLen bytes with
// CRC-32C checksum, and whether it does; an index entry of other length
// or CRC is corrupt.
func (w *Writer) Lookup(id manifest.Hash, rawLen, checksum uint32) (Ref, bool, error) {
	r, ok := w.table.Lookup(id)
	if ok && (r.RawLen != rawLen || r.Checksum != checksum) {
		return Ref{}, false, fmt.Errorf("dedup: chunk %s: the index says %d bytes with CRC-32C %08x, the chunk has %d with %08x: %w",
			id, r.RawLen, r.Checksum, rawLen, checksum, errdefs.ErrCorrupt)
	}
	return r, ok, nil
}

// Add records the new chunk id, written at r in a new pack: Lookup finds
// it from now on, and the index object Commit writes lists it.
func (w *Writer) Add(id manifest.Hash, r Ref) {
	w.table.Add(id, r)
	w.added = append(w.added, Chunk{ID: id, Ref: r})
	w.newStored += int64(r.Stored)
}

// Segment is the index of the pack p among the manifest's segments.
func (w *Writer) Segment(p PackID) int {
	i, ok := w.segOf[p]
	if !ok {
		i = len(w.segs)
		w.segs = append(w.segs, p)
		w.segOf[p] = i
	}
	return i
}

// Describe makes m a format 4 manifest: the packs it references, in
// Segment's order, with their sizes (packs: the new packs, committed), and
// the count of what this capture added. The caller then proves the packs
// there, confirms Lock, writes the index (Index) and commits m, last.
func (w *Writer) Describe(packs []Pack, m *manifest.Manifest) error {
	sizes := map[PackID]int64{}
	for _, p := range packs {
		sizes[p.ID] = p.Size
	}
	m.Segments = make([]manifest.Segment, len(w.segs))
	for i, p := range w.segs {
		size, ok := sizes[p]
		if !ok {
			if size, ok = w.table.PackSize(p); !ok {
				return fmt.Errorf("dedup: pack %s is in no index", p.Name())
			}
		}
		m.Segments[i] = manifest.Segment{Name: p.Name(), Size: size}
	}
	if len(m.Segments) == 0 {
		m.Segments = nil // only zero chunks: nothing to name
	}
	m.SharedChunks = true
	m.Format = manifest.VersionSharedChunks
	m.Stats.NewChunks = int64(len(w.added))
	m.Stats.NewStoredBytes = w.newStored
	return nil
}

// Index writes one index object for the chunks added, which lie in packs.
// Only once the commit is proven: a capture whose lock lapsed may have
// lost packs to gc, and captures that looked its chunks up in an index
// naming them would reference packs that are gone.
func (w *Writer) Index(ctx context.Context, packs []Pack) error {
	if len(w.added) == 0 {
		return nil
	}
	var err error
	w.index, err = WriteIndex(ctx, w.loc, packs, w.added)
	return err
}

// Indexed says Index wrote the index object: another capture may have
// loaded it since and reference the new packs, which an abort then leaves
// to gc rather than delete.
func (w *Writer) Indexed() bool { return w.index != "" }

// Release releases the capture lock.
func (w *Writer) Release(ctx context.Context) { w.Lock.Release(ctx) }

// Skipped are the location's index objects that could not be read
// (corrupt or truncated, Load): the chunks they list are stored again,
// never referenced.
func (w *Writer) Skipped() []BadIndex { return w.table.Skipped() }
