package source

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/testwait"
)

// countingStore counts the chunk reads it serves, to bound read-ahead.
type countingStore struct {
	*mem.Store
	opens atomic.Int64
}

func (s *countingStore) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
	if strings.HasPrefix(name, "segments/") {
		s.opens.Add(1)
	}
	return s.Store.Open(ctx, name, off, length)
}

// blockingWriter takes nothing until released, like a pipe CRIU does not
// read yet.
type blockingWriter struct {
	release chan struct{}
	buf     bytes.Buffer
}

func (w *blockingWriter) Write(p []byte) (int, error) {
	<-w.release
	return w.buf.Write(p)
}

var budgetFiles = [6]struct{}{}

// budgetArchive is an archive of six files of 2 MiB (pages-1.img, ...) in
// chunks of 64 KiB, and the files' bytes.
func budgetArchive(t *testing.T, ctx context.Context) (*countingStore, map[string][]byte, int) {
	t.Helper()
	store := &countingStore{Store: mem.New("budget")}
	out, err := streamer.NewArchiveOutput(ctx, store, 4<<20)
	if err != nil {
		t.Fatal(err)
	}
	const chunk = 64 << 10
	c, _ := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: chunk, Workers: 2, Codec: pipelinetest.MustSpec(t, "lz4")})
	want := map[string][]byte{}
	for i := range budgetFiles {
		name := fmt.Sprintf("pages-%d.img", i+1)
		want[name] = pipelinetest.SmallData(2<<20, uint64(i+1))
		if _, err := c.WriteFile(name, bytes.NewReader(want[name]), false); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		t.Fatal(err)
	}
	return store, want, chunk
}

// Copies through a Behind view draw on its budget alone: with every one of
// them blocked, they hold none of the archive's shared tokens and fetch
// within their own budget, and a plain copy beside them runs through.
func TestArchiveBehindOwnBudget(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	store, want, _ := budgetArchive(t, ctx)
	src, err := OpenArchive(ctx, store, pipeline.Options{Workers: 2, Fetchers: 8})
	if err != nil {
		t.Fatal(err)
	}
	behind := src.Behind(2, 4)
	var names []string
	for name := range want {
		if name != "pages-1.img" {
			names = append(names, name)
		}
	}
	ws, finish := blockedCopies(ctx, behind.Copy, names)
	time.Sleep(testwait.Scale(300 * time.Millisecond))
	if n := len(src.tokens); n != 0 {
		t.Fatalf("copies behind hold %d of the archive's tokens", n)
	}
	if got, bound := store.opens.Load(), int64(4+len(ws)); got > bound {
		t.Fatalf("%d chunks fetched behind with every writer blocked; its budget allows %d", got, bound)
	}
	var b bytes.Buffer
	if _, err := src.Copy(ctx, "pages-1.img", &b); err != nil || !bytes.Equal(b.Bytes(), want["pages-1.img"]) {
		t.Fatalf("plain copy beside them: %d bytes, %v", b.Len(), err)
	}
	finish(t, want)
}

// blockedCopies starts a copy of each of names into a writer that takes
// nothing until finish, which then checks every copy's bytes against
// want.
func blockedCopies(ctx context.Context, copyFile func(context.Context, string, io.Writer) (int64, error), names []string) (map[string]*blockingWriter, func(*testing.T, map[string][]byte)) {
	var wg sync.WaitGroup
	ws := map[string]*blockingWriter{}
	errs := make(chan error, len(names))
	for _, name := range names {
		w := &blockingWriter{release: make(chan struct{})}
		ws[name] = w
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := copyFile(ctx, name, w); err != nil {
				errs <- fmt.Errorf("%s: %w", name, err)
			}
		}()
	}
	return ws, func(t *testing.T, want map[string][]byte) {
		t.Helper()
		for _, w := range ws {
			close(w.release)
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		for name, w := range ws {
			if !bytes.Equal(w.buf.Bytes(), want[name]) {
				t.Fatalf("%s served wrong bytes", name)
			}
		}
	}
}

// Files copied at once share one memory budget: with every writer blocked,
// the chunks fetched ahead stay within the budget (plus one per file), and
// every file still completes once its reader goes on.
func TestArchiveSharedReadBudget(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	store, want, chunk := budgetArchive(t, ctx)
	const files = len(budgetFiles)
	// A budget of 8 chunks (each holds a frame and a decoded chunk).
	limit := int64(8 * (2*chunk + manifest.FrameSize))
	src, err := OpenArchive(ctx, store, pipeline.Options{Workers: 2, Fetchers: 8, MemoryLimit: limit})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for name := range want {
		names = append(names, name)
	}
	_, finish := blockedCopies(ctx, src.Copy, names)
	time.Sleep(testwait.Scale(300 * time.Millisecond))
	if got, bound := store.opens.Load(), int64(8+files); got > bound {
		t.Fatalf("%d chunks fetched with every writer blocked; budget allows %d", got, bound)
	} else {
		t.Logf("%d chunks fetched ahead with every writer blocked (bound %d)", got, bound)
	}
	finish(t, want)
	if n := len(src.tokens); n != 0 {
		t.Fatalf("%d budget tokens still held after every copy", n)
	}
	if got := src.Counters.RawBytes.Load(); got != int64(files*(2<<20)) {
		t.Fatalf("pipeline.Counters.RawBytes = %d", got)
	}
}

// A copy that fails in the middle gives back every token it held.
func TestArchiveCopyFailureReleasesBudget(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	base := pipelinetest.CountGoroutines()
	store := mem.New("fail")
	out, _ := streamer.NewArchiveOutput(ctx, store, 4<<20)
	c, _ := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: 64 << 10, Workers: 2, Codec: pipelinetest.MustSpec(t, "lz4")})
	data := pipelinetest.SmallData(4<<20, 3)
	if _, err := c.WriteFile("pages-1.img", bytes.NewReader(data), false); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		t.Fatal(err)
	}
	src, err := OpenArchive(ctx, store, pipeline.Options{Workers: 2, Fetchers: 6, MemoryLimit: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	for _, limit := range []int64{0, 100, 1 << 20, 3 << 20} {
		w := &failAfter{n: limit}
		if _, err := src.Copy(ctx, "pages-1.img", w); err == nil {
			t.Fatalf("copy into a writer failing after %d bytes succeeded", limit)
		}
		if n := len(src.tokens); n != 0 {
			t.Fatalf("%d budget tokens still held after a failed copy", n)
		}
	}
	var buf bytes.Buffer
	if _, err := src.Copy(ctx, "pages-1.img", &buf); err != nil || !bytes.Equal(buf.Bytes(), data) {
		t.Fatalf("copy after failures: %v", err)
	}
	pipelinetest.WaitGoroutines(t, base)
}

type failAfter struct{ n int64 }

func (w *failAfter) Write(p []byte) (int, error) {
	if int64(len(p)) > w.n {
		return 0, errors.New("pipe closed")
	}
	w.n -= int64(len(p))
	return len(p), nil
}
