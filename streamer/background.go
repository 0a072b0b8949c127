package streamer

// Background files: the fast path's store of device memory (tens of GB,
// from a kept copy that is already safe) shares a capture with CRIU's
// dump, which the checkpoint waits for with the process frozen. Had every
// producer an equal turn at the chunk tokens, CRIU's pages would get one
// turn in seventeen beside sixteen VRAM files: on one H200 the dump of an
// inference server took 1.6 s beside a store of 22 GiB, against 0.8 s
// beside 11 GiB. So a background chunk takes a token only while no
// foreground chunk waits for one. Foreground producers keep the token
// channel's order among themselves; a background producer never queues on
// it (it would be ahead of the next foreground chunk), it tries and
// otherwise waits for a release. Nor do background chunks fill the queue
// to the writer, which admits in order too (where it is shorter than the
// tokens: few cores): they hold at most two tokens fewer than its length.
// A foreground chunk then waits for at most the chunks already in flight,
// and the store takes every token the dump leaves. Nor do they hold more
// than one token per worker: each chunk in flight is a core's work at some
// stage (its read, its sums, its write), and more only queue on the
// output's lanes ahead of the foreground's chunks. On a 16-core GPU host
// (BenchmarkCaptureKept, 16 GiB stored beside 1 GiB of pages), 16 in
// flight against 62 took the pages 0.29 s against 0.63 s and the whole
// capture 1.21 s against 1.26 s; 8 took the store to 1.89 s. That holds
// where the workers have nothing to do (codec none, not sealed): with lz4
// each chunk spends its time on a worker, and 16 in flight took the same
// capture 4.17 s against 3.29 s, a GPU checkpoint 3.58 s against 2.46 s.

import (
	"context"
	"io"
	"sync"

	"github.com/gpucr/gpucr-stream/manifest"
)

// gate orders the chunk tokens between foreground and background chunks.
type gate struct {
	mu       sync.Mutex
	wake     sync.Cond // a token released, no foreground chunk waiting, or the capture stopped
	waiting  int       // foreground chunks waiting for a token
	held     int       // tokens background chunks hold
	most     int       // ... at most
	sleepers int       // background chunks waiting on wake
}

// backgroundChunks bounds the background chunks in flight where it is
// above 0, instead of perWorker (a measuring build sets it).
var backgroundChunks = 0

// init: perWorker is the bound of one chunk per worker, or tokens where it
// does not apply.
func (g *gate) init(ctx context.Context, tokens, queue, perWorker int) {
	if backgroundChunks > 0 {
		perWorker = backgroundChunks
	}
	g.most = max(min(tokens, queue-2, perWorker), 1)
	g.wake.L = &g.mu
	context.AfterFunc(ctx, func() {
		g.mu.Lock()
		g.wake.Broadcast()
		g.mu.Unlock()
	})
}

// signal wakes one background chunk, if one waits: each event frees at
// most a token, and the one it wakes passes the wake on if more are left
// (waking all sixteen of the fast path's at every release, thousands a
// second, would take cores from the driver's checkpoint beside the store).
// Called with mu held.
func (g *gate) signal() {
	if g.sleepers > 0 {
		g.wake.Signal()
	}
}

// WriteBackground is WriteFile of an external file written in the
// background: its chunks enter the pipeline only while no other file's
// chunk waits to.
func (c *Capture) WriteBackground(name string, r io.Reader) (int64, error) {
	return c.writeFile(name, r, manifest.FileFlagExternal, true)
}

// acquire takes a chunk token, for a background chunk only while no
// foreground chunk waits for one.
func (c *Capture) acquire(background bool) error {
	if c.ctx.Err() != nil {
		return context.Cause(c.ctx)
	}
	if background {
		return c.acquireBackground()
	}
	g := &c.gate
	g.mu.Lock()
	g.waiting++
	g.mu.Unlock()
	defer func() {
		g.mu.Lock()
		if g.waiting--; g.waiting == 0 {
			g.signal() // tokens may be left for the background
		}
		g.mu.Unlock()
	}()
	select {
	case c.tokens <- struct{}{}:
		return nil
	case <-c.ctx.Done():
		return context.Cause(c.ctx)
	}
}

func (c *Capture) acquireBackground() error {
	g := &c.gate
	g.mu.Lock()
	defer g.mu.Unlock()
	for {
		if c.ctx.Err() != nil {
			return context.Cause(c.ctx)
		}
		if g.waiting == 0 && g.held < g.most {
			select {
			case c.tokens <- struct{}{}:
				if g.held++; g.held < g.most && len(c.tokens) < cap(c.tokens) {
					g.signal()
				}
				return nil
			default:
			}
		}
		// A release that the try above missed signals under mu, so after
		// this wait has begun, and ends it.
		g.sleepers++
		g.wake.Wait()
		g.sleepers--
	}
}

// releaseToken gives a chunk token back and wakes the background.
func (c *Capture) releaseToken(background bool) {
	<-c.tokens
	g := &c.gate
	g.mu.Lock()
	if background {
		g.held--
	}
	g.signal()
	g.mu.Unlock()
}
