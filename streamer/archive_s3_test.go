package streamer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/testwait"
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
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	store := newGateStore(t.Name())
	out, err := NewArchiveOutput(ctx, store, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	out.SetLanes(lanes)
	bound := int64(DefaultCommitting + lanes - 1)
	c, err := NewCapture(ctx, out, pipeline.Options{ChunkSize: 128 << 10, Workers: 2, Codec: pipelinetest.MustSpec(t, "none")})
	if err != nil {
		t.Fatal(err)
	}
	// More than the lanes hold: segments in commit, each lane's finished
	// one waiting for a slot, its queue and its current one.
	data := pipelinetest.SmallData(12<<20*lanes, 7)
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
	src, err := source.OpenArchive(ctx, store, pipeline.Options{Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	pipelinetest.CheckSource(t, ctx, "archive", src, map[string][]byte{"pages-1.img": data})
}

// A background commit that fails stops the capture: later frames and the
// manifest are refused, and nothing is left in the store.
func TestArchiveBackgroundCommitFails(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	base := pipelinetest.CountGoroutines()
	store := mem.New("bgfail")
	boom := errors.New("server went away")
	store.FailCommit = func(name string) error {
		if isSegment(name, 2) {
			return boom
		}
		return nil
	}
	out, err := NewArchiveOutput(ctx, store, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := NewCapture(ctx, out, pipeline.Options{ChunkSize: 128 << 10, Workers: 2, Codec: pipelinetest.MustSpec(t, "none")})
	_, werr := c.WriteFile("pages-1.img", &patternReader{n: 16 << 20}, false)
	if werr == nil || !errors.Is(werr, boom) {
		t.Logf("WriteFile = %v (the failure may surface at Close)", werr)
	}
	_, cerr := c.Close(ctx, manifest.Manifest{})
	if !errors.Is(cerr, boom) || !strings.Contains(cerr.Error(), manifest.SegmentName(out.streamID, 2)) {
		t.Fatalf("Close = %v, want the commit failure of %s", cerr, manifest.SegmentName(out.streamID, 2))
	}
	if names := store.Names(); len(names) != 0 {
		t.Fatalf("store keeps %v after a failed capture", names)
	}
	pipelinetest.WaitGoroutines(t, base)
}

// Abort with segment commits in flight stops them, waits for them and
// deletes every segment, also those that finished committing meanwhile.
func TestArchiveAbortDuringCommits(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	base := pipelinetest.CountGoroutines()
	store := newGateStore("abort")
	out, err := NewArchiveOutput(ctx, store, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := NewCapture(ctx, out, pipeline.Options{ChunkSize: 128 << 10, Workers: 2, Codec: pipelinetest.MustSpec(t, "none")})
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
	pipelinetest.WaitGoroutines(t, base)
}
