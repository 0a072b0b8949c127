package streamer

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
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/mem"
)

// gateStore holds segment commits until released, as an object store
// does while a segment's last parts upload, and records how many commits
// were in flight at once and whether the manifest came after them all.
type gateStore struct {
	*mem.Store
	gate     chan struct{} // a receive lets one segment commit proceed
	inflight atomic.Int64
	maxSeen  atomic.Int64
	pending  atomic.Int64 // segment commits started and not finished
	early    atomic.Bool  // the manifest was created while a segment commit ran
	started  chan string
}

func newGateStore(name string) *gateStore {
	return &gateStore{Store: mem.New(name), gate: make(chan struct{}), started: make(chan string, 1000)}
}

type gateWriter struct {
	store.ObjectWriter
	s    *gateStore
	name string
}

func (s *gateStore) Create(ctx context.Context, name string) (store.ObjectWriter, error) {
	if name == manifest.ManifestName && s.pending.Load() != 0 {
		s.early.Store(true)
	}
	w, err := s.Store.Create(ctx, name)
	if err != nil {
		return nil, err
	}
	return &gateWriter{ObjectWriter: w, s: s, name: name}, nil
}

func (w *gateWriter) Commit(ctx context.Context) error {
	if w.name == manifest.ManifestName {
		return w.ObjectWriter.Commit(ctx)
	}
	w.s.pending.Add(1)
	defer w.s.pending.Add(-1)
	n := w.s.inflight.Add(1)
	defer w.s.inflight.Add(-1)
	for {
		m := w.s.maxSeen.Load()
		if n <= m || w.s.maxSeen.CompareAndSwap(m, n) {
			break
		}
	}
	w.s.started <- w.name
	select {
	case <-w.s.gate:
	case <-ctx.Done():
		return context.Cause(ctx)
	}
	return w.ObjectWriter.Commit(ctx)
}

// Segments are committed in the background, a bounded number at once, and
// the writer goes on filling the next segment meanwhile; the manifest is
// written only after the last of them. Each lane has DefaultCommitting
// slots, and the others share one more for each other lane.
func TestArchiveCommitsInBackground(t *testing.T) {
	for _, lanes := range []int{1, 3} {
		t.Run(fmt.Sprintf("lanes=%d", lanes), func(t *testing.T) { testCommitsInBackground(t, lanes) })
	}
}

func testCommitsInBackground(t *testing.T, lanes int) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	store := newGateStore(t.Name())
	out, err := NewArchiveOutput(ctx, store, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	out.SetLanes(lanes)
	bound := int64(DefaultCommitting + lanes - 1)
	c, err := NewCapture(ctx, out, Options{ChunkSize: 128 << 10, Workers: 2, Codec: mustSpec(t, "none")})
	if err != nil {
		t.Fatal(err)
	}
	// More than the lanes hold: segments in commit, each lane's finished
	// one waiting for a slot, its queue and its current one.
	data := smallData(12<<20*lanes, 7)
	done := make(chan error, 1)
	go func() {
		_, err := c.WriteFile("pages-1.img", bytes.NewReader(data), false)
		done <- err
	}()
	// With every commit held, the lanes get bound segments ahead and then
	// wait; they are not stuck on the first one.
	for range bound {
		select {
		case <-store.started:
		case <-ctx.Done():
			t.Fatal("segment commits did not start")
		}
	}
	time.Sleep(100 * time.Millisecond)
	if n := store.inflight.Load(); n != bound {
		t.Fatalf("%d commits in flight, want %d", n, bound)
	}
	select {
	case err := <-done:
		t.Fatalf("the whole file went through with every commit held (%v): commits are not bounded", err)
	default:
	}
	// Let the commits through, one by one.
	go func() {
		for {
			select {
			case store.gate <- struct{}{}:
			case <-ctx.Done():
				return
			}
		}
	}()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	m, err := c.Close(ctx, manifest.Manifest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Segments) < 10 {
		t.Fatalf("%d segments for 12 MiB in 1 MiB segments", len(m.Segments))
	}
	if got := store.maxSeen.Load(); got > bound {
		t.Fatalf("%d segment commits in flight at once, bound is %d", got, bound)
	}
	if store.early.Load() {
		t.Fatal("manifest created while a segment commit was still running")
	}
	src, err := OpenArchive(ctx, store, Options{Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	checkSource(t, ctx, "archive", src, map[string][]byte{"pages-1.img": data})
}

// A background commit that fails stops the capture: later frames and the
// manifest are refused, and nothing is left in the store.
func TestArchiveBackgroundCommitFails(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	base := countGoroutines()
	store := mem.New("bgfail")
	boom := errors.New("server went away")
	store.FailCommit = func(name string) error {
		if name == manifest.SegmentName(2) {
			return boom
		}
		return nil
	}
	out, err := NewArchiveOutput(ctx, store, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := NewCapture(ctx, out, Options{ChunkSize: 128 << 10, Workers: 2, Codec: mustSpec(t, "none")})
	_, werr := c.WriteFile("pages-1.img", &patternReader{n: 16 << 20}, false)
	if werr == nil || !errors.Is(werr, boom) {
		t.Logf("WriteFile = %v (the failure may surface at Close)", werr)
	}
	_, cerr := c.Close(ctx, manifest.Manifest{})
	if !errors.Is(cerr, boom) || !strings.Contains(cerr.Error(), manifest.SegmentName(2)) {
		t.Fatalf("Close = %v, want the commit failure of %s", cerr, manifest.SegmentName(2))
	}
	if names := store.Names(); len(names) != 0 {
		t.Fatalf("store keeps %v after a failed capture", names)
	}
	waitGoroutines(t, base)
}

// Abort with segment commits in flight stops them, waits for them and
// deletes every segment, also those that finished committing meanwhile.
func TestArchiveAbortDuringCommits(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	base := countGoroutines()
	store := newGateStore("abort")
	out, err := NewArchiveOutput(ctx, store, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := NewCapture(ctx, out, Options{ChunkSize: 128 << 10, Workers: 2, Codec: mustSpec(t, "none")})
	done := make(chan error, 1)
	go func() {
		_, err := c.WriteFile("pages-1.img", &patternReader{n: 64 << 20}, false)
		done <- err
	}()
	// One commit finishes, the next ones hang.
	<-store.started
	store.gate <- struct{}{}
	<-store.started
	<-store.started
	c.Abort(errors.New("criu dump failed"))
	if err := <-done; err == nil {
		t.Fatal("WriteFile after Abort succeeded")
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err == nil {
		t.Fatal("Close after Abort succeeded")
	}
	if names := store.Names(); len(names) != 0 {
		t.Fatalf("store keeps %v after Abort", names)
	}
	waitGoroutines(t, base)
}

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

// Files copied at once share one memory budget: with every writer blocked,
// the chunks fetched ahead stay within the budget (plus one per file), and
// every file still completes once its reader goes on.
func TestArchiveSharedReadBudget(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	store := &countingStore{Store: mem.New("budget")}
	out, err := NewArchiveOutput(ctx, store, 4<<20)
	if err != nil {
		t.Fatal(err)
	}
	const chunk = 64 << 10
	c, _ := NewCapture(ctx, out, Options{ChunkSize: chunk, Workers: 2, Codec: mustSpec(t, "lz4")})
	want := map[string][]byte{}
	const files = 6
	for i := range files {
		name := fmt.Sprintf("pages-%d.img", i+1)
		want[name] = smallData(2<<20, uint64(i+1))
		if _, err := c.WriteFile(name, bytes.NewReader(want[name]), false); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		t.Fatal(err)
	}
	// A budget of 8 chunks (each holds a frame and a decoded chunk).
	limit := int64(8 * (2*chunk + manifest.FrameSize))
	src, err := OpenArchive(ctx, store, Options{Workers: 2, Fetchers: 8, MemoryLimit: limit})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	ws := map[string]*blockingWriter{}
	errs := make(chan error, files)
	for name := range want {
		w := &blockingWriter{release: make(chan struct{})}
		ws[name] = w
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := src.Copy(ctx, name, w); err != nil {
				errs <- fmt.Errorf("%s: %w", name, err)
			}
		}()
	}
	time.Sleep(300 * time.Millisecond)
	if got, bound := store.opens.Load(), int64(8+files); got > bound {
		t.Fatalf("%d chunks fetched with every writer blocked; budget allows %d", got, bound)
	} else {
		t.Logf("%d chunks fetched ahead with every writer blocked (bound %d)", got, bound)
	}
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
	if n := len(src.tokens); n != 0 {
		t.Fatalf("%d budget tokens still held after every copy", n)
	}
	if got := src.Counters.RawBytes.Load(); got != int64(files*(2<<20)) {
		t.Fatalf("Counters.RawBytes = %d", got)
	}
}

// A copy that fails in the middle gives back every token it held.
func TestArchiveCopyFailureReleasesBudget(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	base := countGoroutines()
	store := mem.New("fail")
	out, _ := NewArchiveOutput(ctx, store, 4<<20)
	c, _ := NewCapture(ctx, out, Options{ChunkSize: 64 << 10, Workers: 2, Codec: mustSpec(t, "lz4")})
	data := smallData(4<<20, 3)
	if _, err := c.WriteFile("pages-1.img", bytes.NewReader(data), false); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		t.Fatal(err)
	}
	src, err := OpenArchive(ctx, store, Options{Workers: 2, Fetchers: 6, MemoryLimit: 1 << 20})
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
	waitGoroutines(t, base)
}

type failAfter struct{ n int64 }

func (w *failAfter) Write(p []byte) (int, error) {
	if int64(len(p)) > w.n {
		return 0, errors.New("pipe closed")
	}
	w.n -= int64(len(p))
	return len(p), nil
}
