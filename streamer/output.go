package streamer

import (
	"context"
	"sync"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
)

// FramePos is where a frame landed: segment index and header offset.
type FramePos struct {
	Segment int
	Pos     int64
	// Ref: the frame was not written; the chunk is stored already, as
	// Stored bytes in Codec (a DedupOutput's reference to a shared chunk).
	Ref    bool
	Stored uint32
	Codec  uint8
}

// Output receives frames from the pipeline's single ordered writer.
// WriteFrame must not keep payload after it returns.
type Output interface {
	WriteFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (FramePos, error)
	// Commit finishes the output; m is complete except for Segments, which an
	// output that writes segments fills in.
	Commit(ctx context.Context, m *manifest.Manifest) error
	// Abort discards what was written where that is possible.
	Abort(ctx context.Context) error
}

// AsyncOutput is an Output that can write a DATA frame's payload after
// WriteFrameAsync returns, several at once (ArchiveOutput on its lanes, StreamOutput on its shards);
// a Capture uses it when its Output has it, and an Output that wraps
// another passes it on. The frame's place, its FramePos, is decided at
// once and in order, as by WriteFrame. done is called exactly once, from
// any goroutine, when payload is no longer needed, with the write's error
// (which also fails the output's later calls); it is not called when
// WriteFrameAsync returns an error. Commit and Abort wait for every write.
type AsyncOutput interface {
	Output
	WriteFrameAsync(ctx context.Context, fh *manifest.FrameHeader, payload []byte, done func(error)) (FramePos, error)
}

// firstFailure keeps an output's first failure, which every later call
// returns; failed is closed with it, for waits to select on.
type firstFailure struct {
	failMu sync.Mutex
	err    error
	failed chan struct{}
}

func newFirstFailure() firstFailure { return firstFailure{failed: make(chan struct{})} }

func (f *firstFailure) failure() error {
	f.failMu.Lock()
	defer f.failMu.Unlock()
	return f.err
}

// setFailure records err unless a failure came first.
func (f *firstFailure) setFailure(err error) {
	f.failMu.Lock()
	defer f.failMu.Unlock()
	if f.err == nil {
		f.err = err
		close(f.failed)
	}
}

// streamHeader is the stream header every shard or segment written in f
// starts with.
func streamHeader(f pipeline.Format, index, count uint16, id uint64) manifest.Header {
	return manifest.Header{ShardIndex: index, ShardCount: count, StreamID: id,
		Encryption: pipeline.EncryptionOf(f.Seal), NoChunkHashes: f.NoChunkHashes(), LateData: f.LateData}
}

// formattedOutput is an Output that says what it writes; one that does
// not writes pipeline.Format{}.
type formattedOutput interface {
	Format() pipeline.Format
}

// FormatOf is what out writes.
func FormatOf(out Output) pipeline.Format {
	if f, ok := out.(formattedOutput); ok {
		return f.Format()
	}
	return pipeline.Format{}
}

// knower is an Output that knows which chunks its destination holds
// (DedupOutput); an Output that wraps another unwraps to it.
type knower interface {
	Knows(id [32]byte) bool
}

// peerChunks is an output whose peer has some chunks already, by content
// id, without deduplicating: a copy beside it still needs their bytes.
type peerChunks interface {
	PeerHas(id [32]byte) bool
}

// peerHasOf says, for a tee whose primary deduplicates against what its
// peer has (a live migration's pre-copy), which chunks the primary will
// not send: the capture stores those raw, for the copy, rather than spend
// the encoding on them in the downtime.
func peerHasOf(out Output) func(id [32]byte) bool {
	t, ok := out.(TeeOutput)
	if !ok || knowerOf(t.Primary) == nil {
		return nil
	}
	if h, ok := t.Primary.(peerChunks); ok {
		return h.PeerHas
	}
	return nil
}

type unwrapper interface {
	Unwrap() Output
}

// knowerOf is out's Knows, or nil when out does not deduplicate.
func knowerOf(out Output) func(id [32]byte) bool {
	for {
		if t, ok := out.(TeeOutput); ok {
			if knowerOf(t.Primary) == nil {
				return nil
			}
			// Cut by content for the primary, but drop no chunk: the
			// copy needs every byte (peerHasOf).
			return func([32]byte) bool { return false }
		}
		if k, ok := out.(knower); ok {
			return k.Knows
		}
		u, ok := out.(unwrapper)
		if !ok {
			return nil
		}
		out = u.Unwrap()
	}
}
