package streamer

import (
	"context"
	"fmt"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/store"
)

// PackWriter writes frames of chunks a location holds already into new
// packs there, as they are (sealed ones stay sealed: they are bound to
// their id, not to a pack): gc's repacking (chunkstore.Marks.Repack),
// which chunkstore leaves to this package because a pack is written by
// the segment writer (ArchiveOutput). One goroutine at a time.
type PackWriter struct {
	out   *ArchiveOutput
	packs map[int]chunkstore.PackID // segment -> pack
}

var _ chunkstore.PackWriter = (*PackWriter)(nil)

// NewPackWriter writes packs of up to segmentSize bytes into the location
// loc, one at a time.
func NewPackWriter(loc store.Store, segmentSize int64) (*PackWriter, error) {
	out, err := newArchiveOutput(loc, segmentSize, pipeline.Format{ChunkHashes: true}, true)
	if err != nil {
		return nil, err
	}
	out.SetLanes(1)
	return &PackWriter{out: out, packs: map[int]chunkstore.PackID{}}, nil
}

// Write writes one DATA frame and says where it lies.
func (p *PackWriter) Write(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (chunkstore.PackID, int64, error) {
	loc, err := p.out.WriteFrame(ctx, fh, payload)
	if err != nil {
		return chunkstore.PackID{}, 0, err
	}
	id, ok := p.packs[loc.Segment]
	if !ok {
		if id, ok = chunkstore.ParsePackName(p.out.segments[loc.Segment].Name); !ok {
			return chunkstore.PackID{}, 0, fmt.Errorf("repack: %s has no pack name", p.out.segments[loc.Segment].Name)
		}
		p.packs[loc.Segment] = id
	}
	return id, loc.Pos, nil
}

// Commit commits the packs written and returns them with their sizes.
func (p *PackWriter) Commit(ctx context.Context) ([]chunkstore.Pack, error) {
	written, err := p.out.commitSegments(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]chunkstore.Pack, len(written))
	for i, s := range written {
		out[i] = chunkstore.Pack{ID: p.packs[i], Size: s.Size}
	}
	return out, nil
}

// Abort deletes the packs written.
func (p *PackWriter) Abort(ctx context.Context) error { return p.out.Abort(ctx) }
