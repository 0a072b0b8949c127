package source

// How ArchiveSource.Copy reads one file. A producer goroutine issues chunk
// indexes in order; each issued chunk holds a credit of the file's window
// (so at most a window of chunks is fetched ahead of the one being
// written) and a memory token (the file's own if free, else one of the
// shared budget: see ArchiveSource). Fetcher goroutines fetch and decode
// the issued chunks; chunk i lands in ring slot i % window, which chunk
// i-window freed when it was written. The caller writes the slots out in
// order and releases each chunk's credit and token. On failure every
// goroutine is stopped and waited for, and the chunks fetched meanwhile
// give their buffers and tokens back.

import (
	"context"
	"fmt"
	"io"
	"sync"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
)

// Copy implements Source. Chunks are fetched in parallel, at most a window
// ahead of the one being written, each holding a token (see ArchiveSource),
// and written in order.
func (a *ArchiveSource) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	return a.copyFile(ctx, name, w, copyLimits{window: a.window, parallel: a.parallel, tokens: a.tokens})
}

// copyLimits are how far one copy reads ahead: its window of chunks, its
// fetchers, and the budget it draws tokens from beyond its own one.
type copyLimits struct {
	window, parallel int
	tokens           chan struct{}
}

// Behind is a view of the archive for reading files ahead of their need
// while a restore runs (the fast path's VRAM files, while CRIU restores):
// its copies share a budget of their own of budget chunks, with fetchers
// fetchers each, so that they never take the tokens that the files CRIU
// waits for read ahead with. Closing it closes the archive.
func (a *ArchiveSource) Behind(fetchers, budget int) Source {
	fetchers = max(1, fetchers)
	return &behind{a, copyLimits{window: max(2, min(a.window, 2*fetchers)), parallel: fetchers, tokens: make(chan struct{}, max(2, budget))}}
}

type behind struct {
	*ArchiveSource
	lim copyLimits
}

func (b *behind) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	return b.copyFile(ctx, name, w, b.lim)
}

func (a *ArchiveSource) copyFile(ctx context.Context, name string, w io.Writer, lim copyLimits) (int64, error) {
	f, ok := a.byName[name]
	if !ok {
		return 0, fmt.Errorf("%s: %w", name, errdefs.ErrNotFound)
	}
	if len(f.Chunks) == 0 {
		return 0, nil
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	c := newFileCopy(a, f, lim)
	c.wg.Add(1 + c.parallel)
	go c.issue(ctx)
	c.startFetchers(ctx)
	written, emitted, err := c.writeOut(ctx, name, w)
	cancel(err)
	c.wg.Wait()
	c.drain(emitted)
	return written, err
}

type fetchResult struct {
	v   fetched
	err error
}

// fileCopy is the state of one Copy.
type fileCopy struct {
	a            *ArchiveSource
	f            *manifest.File
	runs         []run // the reads, when the chunks are read in runs (runs.go); else one a chunk
	n, window    int
	parallel     int
	slots        []chan fetchResult // chunk i uses slot i % window
	shared       []bool             // the slot's token is from tokens
	tokens       chan struct{}      // the shared budget (a.tokens, or a Behind's)
	credits      chan struct{}      // chunks issued and not yet written
	own          chan struct{}      // this file's own token
	next         chan int           // issued chunks, to the fetchers
	issued       int                // chunks handed to the fetchers; read after wg.Wait
	producerDone chan struct{}
	wg           sync.WaitGroup
}

func newFileCopy(a *ArchiveSource, f *manifest.File, lim copyLimits) *fileCopy {
	runs := a.runs[f.Name]
	n := len(f.Chunks)
	if runs != nil {
		n = len(runs)
	}
	window := min(lim.window, n)
	c := &fileCopy{a: a, f: f, runs: runs, n: n, window: window, parallel: max(1, min(lim.parallel, window)), tokens: lim.tokens,
		slots: make([]chan fetchResult, window), shared: make([]bool, window),
		credits: make(chan struct{}, window), own: make(chan struct{}, 1),
		next: make(chan int), producerDone: make(chan struct{})}
	for i := range c.slots {
		c.slots[i] = make(chan fetchResult, 1)
	}
	return c
}

// release gives back chunk i's token and credit.
func (c *fileCopy) release(i int) {
	if c.shared[i%c.window] {
		<-c.tokens
	} else {
		<-c.own
	}
	<-c.credits
}

// issue hands the chunk indexes to the fetchers, each once it holds a
// credit and a token.
func (c *fileCopy) issue(ctx context.Context) {
	defer c.wg.Done()
	defer close(c.producerDone)
	defer close(c.next)
	for i := range c.n {
		select {
		case c.credits <- struct{}{}:
		case <-ctx.Done():
			return
		}
		// Prefer the file's own token, keeping the budget for others.
		select {
		case c.own <- struct{}{}:
			c.shared[i%c.window] = false
		default:
			select {
			case c.own <- struct{}{}:
				c.shared[i%c.window] = false
			case c.tokens <- struct{}{}:
				c.shared[i%c.window] = true
			case <-ctx.Done():
				<-c.credits
				return
			}
		}
		select {
		case c.next <- i:
			c.issued = i + 1
		case <-ctx.Done():
			c.release(i)
			return
		}
	}
}

// startFetchers starts the fetchers with a slow start: one fetch first,
// and each finished fetch lets two more fetchers go, so that the first
// chunk (the one CRIU waits for) does not share the store's bandwidth
// with the whole read-ahead.
func (c *fileCopy) startFetchers(ctx context.Context) {
	ramp := make(chan struct{}, c.parallel)
	for k := range c.parallel {
		go func() {
			defer c.wg.Done()
			if k > 0 {
				select {
				case <-ramp:
				case <-c.producerDone:
				case <-ctx.Done():
					return
				}
			}
			for i := range c.next {
				v, err := c.fetch(ctx, i)
				c.slots[i%c.window] <- fetchResult{v, err}
				for range 2 {
					select {
					case ramp <- struct{}{}:
					default:
					}
				}
			}
		}()
	}
}

// writeOut writes the chunks to w in order. It returns the bytes written
// and how many chunks it took from their slots.
func (c *fileCopy) writeOut(ctx context.Context, name string, w io.Writer) (written int64, emitted int, err error) {
	out := newChunkWriter(w)
	for i := 0; i < c.n && err == nil; i++ {
		select {
		case r := <-c.slots[i%c.window]:
			emitted = i + 1
			if r.err != nil {
				c.release(i)
				return written, emitted, r.err
			}
			if r.v.raw == nil {
				err = out.zeros(r.v.zero)
			} else if spliced, werr := out.write(r.v.raw...); spliced {
				r.v.unmap()
				err = werr
			} else {
				err = werr
			}
			c.a.drop(r.v)
			c.release(i)
			off, n := c.span(i)
			if err != nil {
				return written, emitted, fmt.Errorf("write %s at offset %d: %w", name, off, err)
			}
			written += n
			c.a.Counters.RawBytes.Add(n)
		case <-ctx.Done():
			err = context.Cause(ctx)
		}
	}
	return written, emitted, err
}

// fetch reads read i: a chunk, or a run of them.
func (c *fileCopy) fetch(ctx context.Context, i int) (fetched, error) {
	if c.runs != nil {
		return c.a.fetchRun(ctx, c.f, c.runs[i])
	}
	return c.a.fetch(ctx, c.f, i)
}

// span is where read i starts in the file and how many bytes it holds.
func (c *fileCopy) span(i int) (off, n int64) {
	if c.runs != nil {
		r := c.runs[i]
		return c.f.Chunks[r.first].Offset, r.raw
	}
	return c.f.Chunks[i].Offset, int64(c.f.Chunks[i].RawLen)
}

// drain gives back the buffers and tokens of the chunks fetched after the
// failure; every goroutine has returned.
func (c *fileCopy) drain(emitted int) {
	for i := emitted; i < c.issued; i++ {
		if r := <-c.slots[i%c.window]; r.err == nil {
			c.a.drop(r.v)
		}
		c.release(i)
	}
}
