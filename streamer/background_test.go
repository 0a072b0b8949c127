package streamer

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/testwait"
)

// orderOutput records the files of the DATA frames in the order they reach
// it, each after a pause (a slow disk), so that the producers outrun it.
type orderOutput struct {
	mu    sync.Mutex
	names map[uint32]string
	data  []string
}

func (o *orderOutput) WriteFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (FramePos, error) {
	time.Sleep(100 * time.Microsecond)
	o.mu.Lock()
	defer o.mu.Unlock()
	switch fh.Type {
	case manifest.FrameFile:
		o.names[fh.FileID] = string(payload)
	case manifest.FrameData:
		o.data = append(o.data, o.names[fh.FileID])
	}
	return FramePos{Pos: int64(len(o.data))}, nil
}

func (o *orderOutput) Commit(context.Context, *manifest.Manifest) error { return nil }
func (o *orderOutput) Abort(context.Context) error                      { return nil }

func (o *orderOutput) written() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.data)
}

// A foreground file (CRIU's pages) that starts while eight background
// files (the fast path's store) fill the pipeline waits for the chunks
// already in flight, not for a turn among nine: between its first chunk
// and its last, few background chunks reach the output. Written with
// WriteFile, the eight would put about eight chunks before each of its.
func TestCaptureBackgroundYields(t *testing.T) {
	const chunk = 64 << 10
	const fgChunks, bgFiles, bgChunks = 20, 8, 40
	out := &orderOutput{names: map[uint32]string{}}
	// Workers 1 and no memory budget to speak of: 4 chunk tokens.
	c, err := NewCapture(context.Background(), out, pipeline.Options{Codec: pipelinetest.MustSpec(t, "none"), ChunkSize: chunk, Workers: 1, MemoryLimit: 1})
	if err != nil {
		t.Fatal(err)
	}
	data := pipelinetest.MixedData(bgChunks*chunk, 1)
	var wg sync.WaitGroup
	errs := make(chan error, bgFiles+1)
	for i := range bgFiles {
		wg.Go(func() {
			if _, err := c.WriteBackground(fmt.Sprintf("vram-%d", i), bytes.NewReader(data)); err != nil {
				errs <- err
			}
		})
	}
	for out.written() < 2*bgFiles {
		time.Sleep(time.Millisecond)
	}
	if _, err := c.WriteFile("pages-1.img", bytes.NewReader(data[:fgChunks*chunk]), false); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if _, err := c.Close(context.Background(), manifest.Manifest{}); err != nil {
		t.Fatal(err)
	}
	first, last := -1, -1
	for i, name := range out.data {
		if name == "pages-1.img" {
			if first < 0 {
				first = i
			}
			last = i
		}
	}
	if between := last - first + 1 - fgChunks; between > fgChunks {
		t.Errorf("%d background chunks reached the output between the foreground file's first and last of %d (order: %v)", between, fgChunks, out.data[first:last+1])
	}
	if left := len(out.data) - 1 - last; left == 0 {
		t.Errorf("the background files were done before the foreground file: the test did not run them side by side")
	}
}

// heldOutput holds every DATA frame until release is closed.
type heldOutput struct{ release chan struct{} }

func (o *heldOutput) WriteFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (FramePos, error) {
	if fh.Type == manifest.FrameData {
		select {
		case <-o.release:
		case <-ctx.Done():
			return FramePos{}, context.Cause(ctx)
		}
	}
	return FramePos{}, nil
}

func (o *heldOutput) Commit(context.Context, *manifest.Manifest) error { return nil }
func (o *heldOutput) Abort(context.Context) error                      { return nil }

// Background files hold at most one chunk in flight per worker where the
// workers have nothing to do (codec none), and every token they may
// otherwise (lz4: a bound there starves the workers).
func TestCaptureBackgroundBound(t *testing.T) {
	const workers = 2
	for _, tc := range []struct {
		spec string
		most func(c *Capture) int
	}{
		{"none", func(*Capture) int { return workers }},
		{"lz4", func(c *Capture) int { return min(cap(c.tokens), cap(c.order)-2) }},
	} {
		t.Run(tc.spec, func(t *testing.T) {
			out := &heldOutput{release: make(chan struct{})}
			c, err := NewCapture(context.Background(), out, pipeline.Options{Codec: pipelinetest.MustSpec(t, tc.spec), ChunkSize: 64 << 10, Workers: workers})
			if err != nil {
				t.Fatal(err)
			}
			data := pipelinetest.MixedData(64*(64<<10), 2)
			var wg sync.WaitGroup
			for i := range 4 {
				wg.Go(func() {
					if _, err := c.WriteBackground(fmt.Sprintf("vram-%d", i), bytes.NewReader(data)); err != nil {
						t.Error(err)
					}
				})
			}
			want := tc.most(c)
			deadline := time.Now().Add(testwait.Scale(10 * time.Second))
			for c.heldBackground() < want && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			time.Sleep(50 * time.Millisecond) // more would show by now
			if got := c.heldBackground(); got != want {
				t.Errorf("background chunks in flight with the output held: %d, want %d", got, want)
			}
			close(out.release)
			wg.Wait()
			if _, err := c.Close(context.Background(), manifest.Manifest{}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// heldBackground is how many tokens background chunks hold.
func (c *Capture) heldBackground() int {
	c.gate.mu.Lock()
	defer c.gate.mu.Unlock()
	return c.gate.held
}
