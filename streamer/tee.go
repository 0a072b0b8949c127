package streamer

import (
	"context"
	"errors"
	"sync"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
)

// TeeOutput writes every frame to two outputs, e.g. a peer and a local
// copy kept until the peer confirms. The locations it returns (and so the
// manifest's index) are Copy's; Copy commits first, Primary second.
type TeeOutput struct {
	Primary, Copy Output
}

// WriteFrame implements Output.
func (t TeeOutput) WriteFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (FramePos, error) {
	h := *fh
	if _, err := t.Primary.WriteFrame(ctx, &h, payload); err != nil {
		return FramePos{}, err
	}
	h = *fh
	return t.Copy.WriteFrame(ctx, &h, payload)
}

// WriteFrameAsync implements AsyncOutput: when both outputs are
// AsyncOutputs they write the frame at once, and done is called when both
// have, with the first error; otherwise it is WriteFrame.
func (t TeeOutput) WriteFrameAsync(ctx context.Context, fh *manifest.FrameHeader, payload []byte, done func(error)) (FramePos, error) {
	p, pok := t.Primary.(AsyncOutput)
	c, cok := t.Copy.(AsyncOutput)
	if !pok || !cok {
		loc, err := t.WriteFrame(ctx, fh, payload)
		if err == nil {
			done(nil)
		}
		return loc, err
	}
	w := &teeWrite{left: 2, done: done, over: make(chan struct{})}
	h := *fh
	if _, err := p.WriteFrameAsync(ctx, &h, payload, w.end); err != nil {
		return FramePos{}, err
	}
	h = *fh
	loc, err := c.WriteFrameAsync(ctx, &h, payload, w.end)
	if err != nil {
		// Primary holds payload until its write ends; the caller gets it
		// back with the error, and done is not called.
		w.mu.Lock()
		w.done = nil
		w.mu.Unlock()
		w.end(err)
		<-w.over
		return FramePos{}, err
	}
	return loc, nil
}

// teeWrite is one frame written by both sides of a tee.
type teeWrite struct {
	mu   sync.Mutex
	left int
	err  error
	done func(error)   // nil: the frame was refused, nobody to tell
	over chan struct{} // closed when both sides ended
}

func (w *teeWrite) end(err error) {
	w.mu.Lock()
	if w.err == nil {
		w.err = err
	}
	w.left--
	last, done, first := w.left == 0, w.done, w.err
	w.mu.Unlock()
	if !last {
		return
	}
	if done != nil {
		done(first)
	}
	close(w.over)
}

// Commit implements Output.
func (t TeeOutput) Commit(ctx context.Context, m *manifest.Manifest) error {
	if err := t.Copy.Commit(ctx, m); err != nil {
		return err
	}
	return t.Primary.Commit(ctx, m)
}

// Abort implements Output.
func (t TeeOutput) Abort(ctx context.Context) error {
	return errors.Join(t.Primary.Abort(ctx), t.Copy.Abort(ctx))
}

// Format implements formattedOutput: both outputs must write the same
// frames, so they must share one format (and session, or both have none).
func (t TeeOutput) Format() pipeline.Format {
	return FormatOf(t.Primary)
}

// errTeeFormats is returned when a TeeOutput's outputs disagree.
var errTeeFormats = errors.New("capture: the outputs of a tee must share one format and encryption session")

func checkTee(out Output) error {
	if t, ok := out.(TeeOutput); ok && FormatOf(t.Primary) != FormatOf(t.Copy) {
		return errTeeFormats
	}
	return nil
}
