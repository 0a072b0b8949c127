package streamer

// StreamOutput, moved here from output.go, and its asynchronous mode.
//
// Synchronously every byte of every shard is written on the caller's
// goroutine, one shard after the other: N sockets or pipes move at the
// speed of one writer. Once a Capture calls WriteFrameAsync the output
// switches to a chain per shard: each frame is written by a goroutine of
// its own that first waits for the shard's previous frame, so a shard's
// frames keep the order the caller placed them in while the shards write
// at once. At most shardQueue frames per shard are in flight; the caller
// waits for room. Positions (FramePos.Pos) are decided when a frame is
// placed, from the frame sizes, since the writer has not seen it yet.
// The first failed write fails the output: frames still queued are not
// written, and their done gets that error. Commit queues the END frames
// behind the data and waits for every chain; Abort stops the chains and
// waits for the writes in progress. No goroutine outlives Commit or Abort,
// and none is started before the first asynchronous write.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
)

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
	format  pipeline.Format

	// asynchronous mode, from the first WriteFrameAsync on
	chains []shardChain // nil while synchronous
	writes sync.WaitGroup
	firstFailure
}

// shardChain orders the writes of one shard; only the placing goroutine
// touches it.
type shardChain struct {
	last  chan struct{} // closed when the shard's last placed frame is written
	slots chan struct{} // frames in flight
	pos   int64         // where the next placed frame starts
}

// shardQueue is how many frames each shard has in flight asynchronously:
// enough that a shard never waits for the caller to place its next frame,
// while the capture's chunk budget bounds the memory they hold.
const shardQueue = 8

// errStreamAborted fails the writes still queued when Abort is called.
var errStreamAborted = errors.New("stream aborted")

// NewStreamOutput writes the headers of a plain stream without chunk
// hashes to every shard.
func NewStreamOutput(shards []io.Writer) (*StreamOutput, error) {
	return NewStreamOutputAs(shards, pipeline.Format{})
}

// NewStreamOutputAs writes a stream in format f. A Capture writing to it
// seals every chunk when f is sealed.
func NewStreamOutputAs(shards []io.Writer, f pipeline.Format) (*StreamOutput, error) {
	id := rand.Uint64()
	o := &StreamOutput{trailer: len(shards) == 1, format: f, firstFailure: newFirstFailure()}
	for i, w := range shards {
		mw, err := manifest.NewWriter(w, streamHeader(f, uint16(i), uint16(len(shards)), id))
		if err != nil {
			return nil, fmt.Errorf("shard %d: %w", i, err)
		}
		pipeline.SealEnd(mw, f.Seal)
		o.shards = append(o.shards, mw)
	}
	return o, nil
}

// Format is what the stream is written as.
func (o *StreamOutput) Format() pipeline.Format { return o.format }

// WriteFrame implements Output. Once the output writes asynchronously, a
// FILE or FILE-END frame is queued on every shard (its payload copied)
// and a DATA frame is waited for.
func (o *StreamOutput) WriteFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (FramePos, error) {
	if o.chains != nil {
		return o.writeFrameQueued(ctx, fh, payload)
	}
	if fh.Type != manifest.FrameData {
		for i, s := range o.shards {
			h := *fh
			if _, err := s.WriteFrame(&h, payload); err != nil {
				return FramePos{}, fmt.Errorf("shard %d: %w", i, err)
			}
			if fh.Type == manifest.FrameFileEnd {
				// A file just ended; let readers see it without waiting for more.
				if err := s.Flush(); err != nil {
					return FramePos{}, fmt.Errorf("shard %d: %w", i, err)
				}
			}
		}
		return FramePos{}, nil
	}
	i := o.next
	o.next = (o.next + 1) % len(o.shards)
	pos, err := o.shards[i].WriteFrame(fh, payload)
	if err != nil {
		return FramePos{}, fmt.Errorf("shard %d: %w", i, err)
	}
	return FramePos{Segment: i, Pos: pos}, nil
}

// WriteFrameAsync implements AsyncOutput: a DATA frame is written by its
// shard's chain and done called once that shard wrote it; a FILE or
// FILE-END frame is queued on every shard and done called at once.
func (o *StreamOutput) WriteFrameAsync(ctx context.Context, fh *manifest.FrameHeader, payload []byte, done func(error)) (FramePos, error) {
	if o.chains == nil {
		o.startChains()
	}
	if fh.Type != manifest.FrameData {
		loc, err := o.writeFrameQueued(ctx, fh, payload)
		if err == nil {
			done(nil)
		}
		return loc, err
	}
	h := *fh
	return o.placeNext(ctx, int64(len(payload)), func(w *manifest.Writer) error {
		_, err := w.WriteFrame(&h, payload)
		return err
	}, done)
}

// WriteRefAsync is WriteFrameAsync for a DATA frame whose payload (fh's
// StoredLen bytes) the reader holds already: the frame goes by reference
// (manifest.Writer.WriteRef), in its place among the shard's frames.
func (o *StreamOutput) WriteRefAsync(ctx context.Context, fh *manifest.FrameHeader, done func(error)) (FramePos, error) {
	if o.chains == nil {
		o.startChains()
	}
	h := *fh
	return o.placeNext(ctx, int64(fh.StoredLen), func(w *manifest.Writer) error {
		_, err := w.WriteRef(&h)
		return err
	}, done)
}

// placeNext places a DATA frame's write on the next shard in turn (place),
// and moves the turn on once it is placed.
func (o *StreamOutput) placeNext(ctx context.Context, n int64, write func(*manifest.Writer) error, done func(error)) (FramePos, error) {
	i := o.next
	pos, err := o.place(ctx, i, n, write, done)
	if err != nil {
		return FramePos{}, err
	}
	o.next = (o.next + 1) % len(o.shards)
	return FramePos{Segment: i, Pos: pos}, nil
}

// startChains switches to asynchronous writes, where the synchronous ones
// left the shards.
func (o *StreamOutput) startChains() {
	o.chains = make([]shardChain, len(o.shards))
	for i, s := range o.shards {
		o.chains[i] = shardChain{slots: make(chan struct{}, shardQueue), pos: s.Pos()}
	}
}

// writeFrameQueued is WriteFrame in asynchronous mode.
func (o *StreamOutput) writeFrameQueued(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (FramePos, error) {
	if fh.Type == manifest.FrameData {
		written := make(chan error, 1)
		loc, err := o.WriteFrameAsync(ctx, fh, payload, func(err error) { written <- err })
		if err != nil {
			return FramePos{}, err
		}
		// Not on ctx: payload is the caller's again only once written.
		if err := <-written; err != nil {
			return FramePos{}, err
		}
		return loc, nil
	}
	p := append([]byte(nil), payload...)
	end := fh.Type == manifest.FrameFileEnd
	for i := range o.shards {
		h := *fh
		_, err := o.place(ctx, i, int64(len(p)), func(w *manifest.Writer) error {
			if _, err := w.WriteFrame(&h, p); err != nil {
				return err
			}
			if end {
				// A file just ended; let readers see it without waiting for more.
				return w.Flush()
			}
			return nil
		}, nil)
		if err != nil {
			// On some shards but not the others: the stream is broken.
			o.setFailure(err)
			return FramePos{}, err
		}
	}
	return FramePos{}, nil
}

// place queues write on shard i behind the shard's frames placed before,
// once the shard has room, and returns where the frame (n payload bytes)
// starts. done, if set, gets the write's error after it.
func (o *StreamOutput) place(ctx context.Context, i int, n int64, write func(*manifest.Writer) error, done func(error)) (int64, error) {
	if err := o.failure(); err != nil {
		return 0, err
	}
	c := &o.chains[i]
	select {
	case c.slots <- struct{}{}:
	case <-ctx.Done():
		return 0, context.Cause(ctx)
	case <-o.failed:
		return 0, o.failure()
	}
	pos := c.pos
	c.pos += manifest.FrameSize + n
	prev, last := c.last, make(chan struct{})
	c.last = last
	o.writes.Add(1)
	go func() {
		defer o.writes.Done()
		if prev != nil {
			<-prev
		}
		err := o.failure()
		if w := o.shards[i]; err == nil {
			if w.Pos() != pos {
				// Never: the index would point elsewhere.
				err = fmt.Errorf("frame placed at offset %d, the shard is at %d", pos, w.Pos())
			} else {
				err = write(w)
			}
			if err != nil {
				err = fmt.Errorf("shard %d: %w", i, err)
				o.setFailure(err)
			}
		}
		close(last)
		<-c.slots
		if done != nil {
			done(err)
		}
	}()
	return pos, nil
}

// Commit writes the END frame and tail of every shard; asynchronously,
// behind every frame placed, returning once all are written.
func (o *StreamOutput) Commit(ctx context.Context, m *manifest.Manifest) error {
	var trailer []byte
	if o.trailer {
		var err error
		if trailer, err = pipeline.MarshalManifest(m, o.format.Seal); err != nil {
			if o.chains != nil {
				o.setFailure(err)
				o.writes.Wait()
			}
			return err
		}
	}
	if o.chains != nil {
		return o.commitQueued(ctx, trailer)
	}
	for i, s := range o.shards {
		if err := s.Finish(trailer); err != nil {
			return fmt.Errorf("shard %d: %w", i, err)
		}
	}
	return nil
}

func (o *StreamOutput) commitQueued(ctx context.Context, trailer []byte) error {
	defer o.writes.Wait()
	for i := range o.shards {
		if _, err := o.place(ctx, i, 0, func(w *manifest.Writer) error { return w.Finish(trailer) }, nil); err != nil {
			o.setFailure(err)
			return err
		}
	}
	o.writes.Wait()
	return o.failure()
}

// Sizes returns the bytes written to each shard; after Commit or Abort
// when the output wrote asynchronously.
func (o *StreamOutput) Sizes() []int64 {
	out := make([]int64, len(o.shards))
	for i, s := range o.shards {
		out[i] = s.Pos()
	}
	return out
}

// Abort leaves the stream without an END frame, which every reader
// rejects. Asynchronously, the frames still queued are dropped and the
// writes in progress waited for.
func (o *StreamOutput) Abort(ctx context.Context) error {
	if o.chains != nil {
		o.setFailure(errStreamAborted)
		o.writes.Wait()
	}
	for _, s := range o.shards {
		_ = s.Flush()
	}
	return nil
}
