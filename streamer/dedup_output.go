package streamer

// A deduplicated checkpoint (format 4) keeps its chunks in the chunk store
// of the location that holds it (chunkstore): DedupOutput looks each chunk
// up by its content id, writes the chunks the location does not hold yet
// into new packs (an ArchiveOutput in pack mode, on lanes like segments),
// and references the others where they are. Its commit waits for the new
// packs, writes one index object for their chunks, and then the manifest,
// which names every pack it references, last.
//
// FILE and FILE-END frames write nothing: the manifest says what they
// would, and a checkpoint is read only through it.

import (
	"context"
	"errors"
	"fmt"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/store"
)

// DedupOutput writes a format 4 checkpoint into ckpt, its chunks into the
// chunk store of loc, the location that holds ckpt.
type DedupOutput struct {
	ckpt  store.Store
	loc   store.Store
	table *chunkstore.Table
	packs *ArchiveOutput
	lock  *chunkstore.Lock
	seal  *crypt.Session // nil: not encrypted

	// the writer's goroutine only
	segOf     map[chunkstore.PackID]int // pack -> index in segs
	segs      []chunkstore.PackID
	newPack   map[int]chunkstore.PackID // packs output segment -> pack
	added     []chunkstore.Chunk
	newStored int64
	index     string // the index object written, once it is
	done      bool
}

// NewDedupOutput opens the chunk store of loc for a checkpoint written into
// ckpt (a checkpoint of loc): it takes a capture lock and loads the index,
// once. It refuses a ckpt that holds a checkpoint already. With seal, the
// checkpoint is encrypted: chunk ids are keyed hashes under seal's key, so
// only checkpoints of that key share chunks, and chunks are sealed for the
// store (crypt.Session.SealShared).
func NewDedupOutput(ctx context.Context, ckpt, loc store.Store, segmentSize int64, seal *crypt.Session) (*DedupOutput, error) {
	if _, err := ckpt.Stat(ctx, manifest.ManifestName); err == nil {
		return nil, fmt.Errorf("%s: a checkpoint already exists there; remove it first", ckpt)
	} else if !errors.Is(err, errdefs.ErrNotFound) {
		return nil, fmt.Errorf("%s: %w", ckpt, err)
	}
	packs, err := newArchiveOutput(loc, segmentSize, pipeline.Format{ChunkHashes: true}, true)
	if err != nil {
		return nil, err
	}
	lock, err := chunkstore.TakeLock(ctx, loc, chunkstore.LockCapture)
	if err != nil {
		return nil, err
	}
	d := &DedupOutput{ckpt: ckpt, loc: loc, packs: packs, lock: lock, seal: seal, table: chunkstore.NewTable(),
		segOf: map[chunkstore.PackID]int{}, newPack: map[int]chunkstore.PackID{}}
	// While a gc holds the location, share nothing: gc may delete any
	// pack the index lists (chunkstore/lock.go).
	if len(lock.Others[chunkstore.LockGC]) == 0 {
		if d.table, err = chunkstore.Load(ctx, loc); err != nil {
			lock.Release(ctx)
			return nil, err
		}
	}
	return d, nil
}

// SetLanes sets how many packs are written at once (ArchiveOutput.SetLanes).
func (d *DedupOutput) SetLanes(n int) { d.packs.SetLanes(n) }

// Format implements formattedOutput: chunks carry their BLAKE3 hash (keyed
// when encrypted), which is their id.
func (d *DedupOutput) Format() pipeline.Format {
	return pipeline.Format{Seal: d.seal, ChunkHashes: true, Shared: true}
}

// Knows says the location holds the chunk id already: a capture need not
// encode it. Safe from any goroutine.
func (d *DedupOutput) Knows(id [32]byte) bool { return d.table.Has(id) }

// WriteFrame implements Output.
func (d *DedupOutput) WriteFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (FramePos, error) {
	return d.write(ctx, fh, payload, nil)
}

// WriteFrameAsync implements AsyncOutput.
func (d *DedupOutput) WriteFrameAsync(ctx context.Context, fh *manifest.FrameHeader, payload []byte, done func(error)) (FramePos, error) {
	return d.write(ctx, fh, payload, done)
}

// write places a DATA frame: a zero chunk nowhere, a known chunk where it
// is, a new one in a pack. done, when set, is called once payload is free.
func (d *DedupOutput) write(ctx context.Context, fh *manifest.FrameHeader, payload []byte, done func(error)) (FramePos, error) {
	finish := func(loc FramePos, err error) (FramePos, error) {
		if done != nil && err == nil {
			done(nil)
		}
		return loc, err
	}
	if fh.Type == manifest.FrameFileEnd {
		d.packs.unstick(fh.FileID)
	}
	if fh.Type != manifest.FrameData || codec.ID(fh.Codec) == codec.Zero {
		return finish(FramePos{}, nil)
	}
	id := manifest.Hash(fh.Hash)
	if id == (manifest.Hash{}) {
		return finish(FramePos{}, errors.New("dedup: chunk without a content id"))
	}
	if r, ok := d.table.Lookup(id); ok {
		if r.RawLen != fh.RawLen || r.Checksum != fh.Checksum {
			return finish(FramePos{}, fmt.Errorf("dedup: chunk %s: the index says %d bytes with CRC-32C %08x, the chunk has %d with %08x: %w",
				id, r.RawLen, r.Checksum, fh.RawLen, fh.Checksum, errdefs.ErrCorrupt))
		}
		return finish(FramePos{Segment: d.segment(r.Pack), Pos: r.Pos, Ref: true, Stored: r.Stored, Codec: r.Codec}, nil)
	}
	if fh.StoredLen == 0 && fh.RawLen > 0 && codec.ID(fh.Codec) == codec.None {
		// The capture skipped encoding it because Knows said yes; the
		// table only grows, so this is a bug, not bad input.
		return finish(FramePos{}, fmt.Errorf("dedup: chunk %s was known and is not", id))
	}
	// In a pack a frame stands for its content alone: no file, no offset.
	pf := *fh
	pf.FileID, pf.Offset = 0, 0
	var loc FramePos
	var err error
	d.packs.packFile = fh.FileID
	if done != nil {
		loc, err = d.packs.WriteFrameAsync(ctx, &pf, payload, done)
	} else {
		loc, err = d.packs.WriteFrame(ctx, &pf, payload)
	}
	if err != nil {
		return FramePos{}, err
	}
	pack, ok := d.newPack[loc.Segment]
	if !ok {
		pack, ok = chunkstore.ParsePackName(d.packs.segments[loc.Segment].Name)
		if !ok {
			return FramePos{}, fmt.Errorf("dedup: pack %s has no pack name", d.packs.segments[loc.Segment].Name)
		}
		d.newPack[loc.Segment] = pack
	}
	r := chunkstore.Ref{Pack: pack, Pos: loc.Pos, RawLen: fh.RawLen, Stored: fh.StoredLen, Codec: fh.Codec, Checksum: fh.Checksum}
	d.table.Add(id, r)
	d.added = append(d.added, chunkstore.Chunk{ID: id, Ref: r})
	d.newStored += int64(fh.StoredLen)
	return FramePos{Segment: d.segment(pack), Pos: loc.Pos}, nil
}

// segment is the index of pack in the manifest's segments.
func (d *DedupOutput) segment(p chunkstore.PackID) int {
	i, ok := d.segOf[p]
	if !ok {
		i = len(d.segs)
		d.segs = append(d.segs, p)
		d.segOf[p] = i
	}
	return i
}

// Commit implements Output: the new packs, their index object, then the
// manifest (format 4), which lists the packs it references, once they are
// proven there (prove).
func (d *DedupOutput) Commit(ctx context.Context, m *manifest.Manifest) error {
	d.done = true
	defer d.lock.Release(ctx)
	written, err := d.packs.commitSegments(ctx)
	if err != nil {
		return err
	}
	sizes := map[chunkstore.PackID]int64{}
	var newPacks []chunkstore.Pack
	for i, s := range written {
		p := d.newPack[i]
		sizes[p] = s.Size
		newPacks = append(newPacks, chunkstore.Pack{ID: p, Size: s.Size})
	}
	if len(d.added) > 0 {
		if d.index, err = chunkstore.WriteIndex(ctx, d.loc, newPacks, d.added); err != nil {
			return err
		}
	}
	m.Segments = make([]manifest.Segment, len(d.segs))
	for i, p := range d.segs {
		size, ok := sizes[p]
		if !ok {
			if size, ok = d.table.PackSize(p); !ok {
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
	m.Stats.NewChunks = int64(len(d.added))
	m.Stats.NewStoredBytes = d.newStored
	// Each pack looked up: the location may hold many more than these.
	if err := prove(ctx, d.lock.Lock, d.loc, m.Segments, ""); err != nil {
		return err
	}
	return commitManifest(ctx, d.ckpt, m, d.Format())
}

// Abort implements Output: the packs written so far are deleted, unless
// their index object was written: another capture may have loaded it
// since, and reference them; gc takes them then.
func (d *DedupOutput) Abort(ctx context.Context) error {
	if !d.done {
		defer d.lock.Release(ctx)
	}
	d.done = true
	if d.index != "" {
		return nil
	}
	return d.packs.Abort(ctx)
}

// SkippedIndex are the location's index objects that could not be read
// (corrupt or truncated, chunkstore.Load): the chunks they list are
// stored again, never referenced.
func (d *DedupOutput) SkippedIndex() []chunkstore.BadIndex { return d.table.Skipped() }
