package streamer

// A deduplicated checkpoint (format 4) keeps its chunks in the chunk store
// of the location that holds it: DedupOutput writes the chunks the
// location does not hold yet into new packs (an ArchiveOutput in pack
// mode, on lanes like segments) and references the others where they are;
// what the store holds, the lock and the index object are a
// chunkstore.Writer's. Its commit waits for the new packs, has the writer
// write their index object, and then writes the manifest, which names
// every pack it references, last, once they are proven there.
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
	ckpt   store.Store
	loc    store.Store
	chunks *chunkstore.Writer
	packs  *ArchiveOutput
	seal   *crypt.Session // nil: not encrypted

	// the writer's goroutine only
	newPack map[int]chunkstore.PackID // packs output segment -> pack
	done    bool
}

// NewDedupOutput opens the chunk store of loc for a checkpoint written into
// ckpt (a checkpoint of loc): it takes a capture lock and loads the index,
// once (chunkstore.NewWriter). It refuses a ckpt that holds a checkpoint
// already. With seal, the checkpoint is encrypted: chunk ids are keyed
// hashes under seal's key, so only checkpoints of that key share chunks,
// and chunks are sealed for the store (crypt.Session.SealShared).
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
	chunks, err := chunkstore.NewWriter(ctx, loc)
	if err != nil {
		return nil, err
	}
	return &DedupOutput{ckpt: ckpt, loc: loc, chunks: chunks, packs: packs, seal: seal, newPack: map[int]chunkstore.PackID{}}, nil
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
func (d *DedupOutput) Knows(id [32]byte) bool { return d.chunks.Knows(id) }

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
	if r, ok, err := d.chunks.Lookup(id, fh.RawLen, fh.Checksum); err != nil {
		return finish(FramePos{}, err)
	} else if ok {
		return finish(FramePos{Segment: d.chunks.Segment(r.Pack), Pos: r.Pos, Ref: true, Stored: r.Stored, Codec: r.Codec}, nil)
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
	d.chunks.Add(id, r)
	return FramePos{Segment: d.chunks.Segment(pack), Pos: loc.Pos}, nil
}

// Commit implements Output: the new packs, then, once every pack the
// manifest (format 4) lists is proven there (prove), their index object
// and the manifest. A capture whose lock lapsed writes no index object:
// gc may have taken its packs, and captures that looked their chunks up
// would reference packs that are gone.
func (d *DedupOutput) Commit(ctx context.Context, m *manifest.Manifest) error {
	d.done = true
	defer d.chunks.Release(ctx)
	written, err := d.packs.commitSegments(ctx)
	if err != nil {
		return err
	}
	newPacks := make([]chunkstore.Pack, len(written))
	for i, s := range written {
		newPacks[i] = chunkstore.Pack{ID: d.newPack[i], Size: s.Size}
	}
	if err := d.chunks.Describe(newPacks, m); err != nil {
		return err
	}
	// Each pack looked up: the location may hold many more than these.
	if err := prove(ctx, d.chunks.Lock.Lock, d.loc, m.Segments, ""); err != nil {
		return err
	}
	if err := d.chunks.Index(ctx, newPacks); err != nil {
		return err
	}
	return commitManifest(ctx, d.ckpt, m, d.Format())
}

// Abort implements Output: the packs written so far are deleted, unless
// their index object was written: another capture may have loaded it
// since, and reference them; gc takes them then.
func (d *DedupOutput) Abort(ctx context.Context) error {
	if !d.done {
		defer d.chunks.Release(ctx)
	}
	d.done = true
	if d.chunks.Indexed() {
		return nil
	}
	return d.packs.Abort(ctx)
}

// SkippedIndex are the location's index objects that could not be read
// (corrupt or truncated, chunkstore.Load): the chunks they list are
// stored again, never referenced.
func (d *DedupOutput) SkippedIndex() []chunkstore.BadIndex { return d.chunks.Skipped() }
