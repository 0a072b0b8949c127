package streamer

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"

	"github.com/gpucr/gpucr-stream/manifest"
)

// Location is where a frame landed: segment index and header offset.
type Location struct {
	Segment int
	Pos     int64
}

// Output receives frames from the pipeline's single ordered writer.
// WriteFrame must not keep payload after it returns.
type Output interface {
	WriteFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (Location, error)
	// Commit finishes the output; m is complete except for Segments, which an
	// output that writes segments fills in.
	Commit(ctx context.Context, m *manifest.Manifest) error
	// Abort discards what was written where that is possible.
	Abort(ctx context.Context) error
}

// StreamOutput writes one stream over one or more shards (pipes, stdout, a
// socket). DATA frames go round-robin; FILE and FILE-END frames go to every
// shard, so each shard is a well-formed stream and a reader can gather them
// in any order.
type StreamOutput struct {
	shards []*manifest.Writer
	next   int
	// Trailer selects whether the END frame carries the manifest; only a
	// single-shard stream has an index that means something on its own.
	trailer bool
}

// NewStreamOutput writes stream headers to every shard.
func NewStreamOutput(shards []io.Writer) (*StreamOutput, error) {
	id := rand.Uint64()
	o := &StreamOutput{trailer: len(shards) == 1}
	for i, w := range shards {
		mw, err := manifest.NewWriter(w, manifest.Header{ShardIndex: uint16(i), ShardCount: uint16(len(shards)), StreamID: id})
		if err != nil {
			return nil, fmt.Errorf("shard %d: %w", i, err)
		}
		o.shards = append(o.shards, mw)
	}
	return o, nil
}

// WriteFrame implements Output.
func (o *StreamOutput) WriteFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (Location, error) {
	if fh.Type != manifest.FrameData {
		for i, s := range o.shards {
			h := *fh
			if _, err := s.WriteFrame(&h, payload); err != nil {
				return Location{}, fmt.Errorf("shard %d: %w", i, err)
			}
			if fh.Type == manifest.FrameFileEnd {
				// A file just ended; let readers see it without waiting for more.
				if err := s.Flush(); err != nil {
					return Location{}, fmt.Errorf("shard %d: %w", i, err)
				}
			}
		}
		return Location{}, nil
	}
	i := o.next
	o.next = (o.next + 1) % len(o.shards)
	pos, err := o.shards[i].WriteFrame(fh, payload)
	if err != nil {
		return Location{}, fmt.Errorf("shard %d: %w", i, err)
	}
	return Location{Segment: i, Pos: pos}, nil
}

// Commit writes the END frame and tail of every shard.
func (o *StreamOutput) Commit(ctx context.Context, m *manifest.Manifest) error {
	var trailer []byte
	if o.trailer {
		var err error
		if trailer, err = m.Marshal(); err != nil {
			return err
		}
	}
	for i, s := range o.shards {
		if err := s.Finish(trailer); err != nil {
			return fmt.Errorf("shard %d: %w", i, err)
		}
	}
	return nil
}

// Sizes returns the bytes written to each shard.
func (o *StreamOutput) Sizes() []int64 {
	out := make([]int64, len(o.shards))
	for i, s := range o.shards {
		out[i] = s.Pos()
	}
	return out
}

// Abort leaves the stream without an END frame, which every reader rejects.
func (o *StreamOutput) Abort(ctx context.Context) error {
	for _, s := range o.shards {
		_ = s.Flush()
	}
	return nil
}

// DefaultSegmentSize keeps segments large enough that per-object overhead
// does not matter and small enough for parallel transfers.
const DefaultSegmentSize = 256 << 20

// ArchiveOutput writes an archive into a Store: segment objects as data
// arrives, then the manifest last as the commit point.
type ArchiveOutput struct {
	store       Store
	segmentSize int64
	cur         ObjectWriter
	curWriter   *manifest.Writer
	segments    []manifest.Segment
	streamID    uint64
	// open files, re-announced at the start of every new segment
	open map[uint32]openFile
}

type openFile struct {
	fh   manifest.FrameHeader
	name []byte
}

// NewArchiveOutput refuses to overwrite a committed archive.
func NewArchiveOutput(ctx context.Context, store Store, segmentSize int64) (*ArchiveOutput, error) {
	if _, err := store.Stat(ctx, manifest.ManifestName); err == nil {
		return nil, fmt.Errorf("%s: a checkpoint already exists there; remove it first", store)
	}
	if segmentSize <= 0 {
		segmentSize = DefaultSegmentSize
	}
	return &ArchiveOutput{store: store, segmentSize: segmentSize, streamID: rand.Uint64(), open: map[uint32]openFile{}}, nil
}

func (a *ArchiveOutput) openSegment(ctx context.Context) error {
	i := len(a.segments)
	name := manifest.SegmentName(i)
	w, err := a.store.Create(ctx, name)
	if err != nil {
		return fmt.Errorf("create segment %s: %w", name, err)
	}
	mw, err := manifest.NewWriter(w, manifest.Header{ShardIndex: 0, ShardCount: 1, StreamID: a.streamID})
	if err != nil {
		_ = w.Abort(ctx)
		return fmt.Errorf("segment %s: %w", name, err)
	}
	a.cur, a.curWriter = w, mw
	a.segments = append(a.segments, manifest.Segment{Name: name})
	for _, f := range a.open {
		fh := f.fh
		if _, err := mw.WriteFrame(&fh, f.name); err != nil {
			return fmt.Errorf("segment %s: %w", name, err)
		}
	}
	return nil
}

func (a *ArchiveOutput) closeSegment(ctx context.Context) error {
	if a.cur == nil {
		return nil
	}
	seg := &a.segments[len(a.segments)-1]
	if err := a.curWriter.Finish(nil); err != nil {
		return fmt.Errorf("finish segment %s: %w", seg.Name, err)
	}
	seg.Size = a.curWriter.Pos()
	if err := a.cur.Commit(ctx); err != nil {
		return fmt.Errorf("commit segment %s: %w", seg.Name, err)
	}
	a.cur, a.curWriter = nil, nil
	return nil
}

// WriteFrame implements Output. FILE frames are repeated in each segment
// that carries the file's data, so every segment decodes on its own.
func (a *ArchiveOutput) WriteFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (Location, error) {
	if a.cur != nil && a.curWriter.Pos() >= a.segmentSize {
		if err := a.closeSegment(ctx); err != nil {
			return Location{}, err
		}
	}
	if a.cur == nil {
		if err := a.openSegment(ctx); err != nil {
			return Location{}, err
		}
	}
	pos, err := a.curWriter.WriteFrame(fh, payload)
	if err != nil {
		return Location{}, fmt.Errorf("segment %s: %w", a.segments[len(a.segments)-1].Name, err)
	}
	switch fh.Type {
	case manifest.FrameFile:
		a.open[fh.FileID] = openFile{fh: *fh, name: append([]byte(nil), payload...)}
	case manifest.FrameFileEnd:
		delete(a.open, fh.FileID)
	}
	return Location{Segment: len(a.segments) - 1, Pos: pos}, nil
}

// Commit closes the last segment, then writes the manifest.
func (a *ArchiveOutput) Commit(ctx context.Context, m *manifest.Manifest) error {
	if err := a.closeSegment(ctx); err != nil {
		return err
	}
	m.Segments = a.segments
	if err := m.Validate(); err != nil {
		return fmt.Errorf("refusing to commit: %w", err)
	}
	doc, err := m.Marshal()
	if err != nil {
		return err
	}
	w, err := a.store.Create(ctx, manifest.ManifestName)
	if err != nil {
		return fmt.Errorf("create manifest: %w", err)
	}
	if _, err := w.Write(doc); err != nil {
		_ = w.Abort(ctx)
		return fmt.Errorf("write manifest: %w", err)
	}
	if err := w.Commit(ctx); err != nil {
		_ = w.Abort(ctx)
		return fmt.Errorf("commit manifest: %w", err)
	}
	return nil
}

// Abort removes the segments written so far; with no manifest they were
// never a checkpoint, so this is cleanup, not a correctness step.
func (a *ArchiveOutput) Abort(ctx context.Context) error {
	if a.cur != nil {
		_ = a.cur.Abort(ctx)
		a.cur = nil
	}
	var first error
	for _, s := range a.segments {
		if err := a.store.Delete(ctx, s.Name); err != nil && first == nil {
			first = err
		}
	}
	return first
}
