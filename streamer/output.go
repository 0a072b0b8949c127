package streamer

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"

	"github.com/gpucr/gpucr-stream/crypt"
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

// AsyncOutput is an Output that can write a DATA frame's payload after
// WriteFrameAsync returns, several at once (ArchiveOutput, on its lanes);
// a Capture uses it when its Output has it, and an Output that wraps
// another passes it on. The frame's place, its Location, is decided at
// once and in order, as by WriteFrame. done is called exactly once, from
// any goroutine, when payload is no longer needed, with the write's error
// (which also fails the output's later calls); it is not called when
// WriteFrameAsync returns an error. Commit and Abort wait for every write.
type AsyncOutput interface {
	Output
	WriteFrameAsync(ctx context.Context, fh *manifest.FrameHeader, payload []byte, done func(error)) (Location, error)
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
	seal    *crypt.Session
}

// NewStreamOutput writes stream headers to every shard.
func NewStreamOutput(shards []io.Writer) (*StreamOutput, error) {
	return NewSealedStreamOutput(shards, nil)
}

// NewSealedStreamOutput writes an encrypted stream under seal (nil: a
// plain one). A Capture writing to it seals every chunk.
func NewSealedStreamOutput(shards []io.Writer, seal *crypt.Session) (*StreamOutput, error) {
	id := rand.Uint64()
	o := &StreamOutput{trailer: len(shards) == 1, seal: seal}
	for i, w := range shards {
		mw, err := manifest.NewWriter(w, manifest.Header{ShardIndex: uint16(i), ShardCount: uint16(len(shards)), StreamID: id, Encryption: encryptionOf(seal)})
		if err != nil {
			return nil, fmt.Errorf("shard %d: %w", i, err)
		}
		sealEnd(mw, seal)
		o.shards = append(o.shards, mw)
	}
	return o, nil
}

// Sealed is the session the stream is encrypted under, or nil.
func (o *StreamOutput) Sealed() *crypt.Session { return o.seal }

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
		if trailer, err = marshalManifest(m, o.seal); err != nil {
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
