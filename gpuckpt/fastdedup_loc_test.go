package gpuckpt

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/gpucr/gpucr-stream/catalog"
	"github.com/gpucr/gpucr-stream/cudadriver/drivertest"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/vram/vramtest"
)

// dedupLoc is a location directory that --dedup checkpoints of a fast-path
// process go into, through the capture and the chunk store (no CRIU).
type dedupLoc struct {
	t   *testing.T
	tg  *vramtest.Target
	dir string
	cfg location.Config
	mu  sync.Mutex
	log []string
}

func newDedupLoc(t *testing.T, tg *vramtest.Target) *dedupLoc {
	t.Setenv("GPUCR_PRELOAD_DIR", tg.SockDir)
	return &dedupLoc{t: t, tg: tg, dir: t.TempDir(),
		cfg: location.Config{Options: pipeline.Options{Dedup: true, ChunkSize: 256 << 10, Workers: 2}, SegmentSize: 4 << 20}}
}

func (l *dedupLoc) store() store.Store { return dir.New(l.dir) }

func (l *dedupLoc) dest(name string) location.Location {
	d, err := location.Parse(filepath.Join(l.dir, name))
	if err != nil {
		l.t.Fatal(err)
	}
	return d
}

// logged is what the fast path said since the last call.
func (l *dedupLoc) logged() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := strings.Join(l.log, "\n")
	l.log = nil
	return s
}

// suspend starts the checkpoint name: the fast path has released the
// memory and stores it into the capture.
func (l *dedupLoc) suspend(ctx context.Context, name string) (*Checkpoint, *streamer.Capture, *manifest.Manifest) {
	l.t.Helper()
	dest := l.dest(name)
	c, _, err := location.StartCapture(ctx, dest, l.cfg)
	if err != nil {
		l.t.Fatal(err)
	}
	cc := &Checkpoint{drv: drivertest.NewFake(l.tg.PID), pids: []int{l.tg.PID}}
	meta := &manifest.Manifest{}
	f := FastPath{Files: 3, KeepDir: l.t.TempDir(), Dedup: &DedupTarget{Dest: dest, Open: l.cfg}}
	if _, err := cc.FastSuspend(ctx, f, true, c, meta, func(s string) { l.mu.Lock(); l.log = append(l.log, s); l.mu.Unlock() }); err != nil {
		location.AbortCapture(ctx, c, err)
		l.t.Fatal(err)
	}
	if cc.fast == nil {
		l.t.Fatal("the fast path was not taken")
	}
	return cc, c, meta
}

// commit ends a suspended checkpoint as a checkpoint does, and restores
// the process from it (after the driver's restore, which the fake
// skips).
func (l *dedupLoc) commit(ctx context.Context, name string, cc *Checkpoint, c *streamer.Capture, meta *manifest.Manifest) *manifest.Manifest {
	l.t.Helper()
	if err := cc.fast.Detach(ctx); err != nil {
		l.t.Fatal(err)
	}
	if err := cc.FastWait(ctx); err != nil {
		location.AbortCapture(ctx, c, err)
		l.t.Fatal(err)
	}
	m, err := c.Close(ctx, *meta)
	if err != nil {
		l.t.Fatal(err)
	}
	cc.FastCommit()
	src, err := location.OpenSource(ctx, l.dest(name), l.cfg, source.StreamSourceOptions{})
	if err != nil {
		l.t.Fatal(err)
	}
	defer src.Close()
	if _, err := FastRestore(ctx, src, nil, nil, m.CUDA, []int{l.tg.PID}); err != nil {
		l.t.Fatal(err)
	}
	l.tg.MustBeIntact(l.t)
	return m
}

// readBack is what cc's earlier checkpoints have read of their chunks so
// far (its block hashes, and whatever the store or an undo read back).
func readBack(cc *Checkpoint) int64 {
	var n int64
	for _, s := range cc.earlier.srcs {
		n += s.(*source.ArchiveSource).Counters.StoredRaw.Load()
	}
	return n
}

// gc runs `gpucr-stream gc` on the location, as at the command line.
func (l *dedupLoc) gc(ctx context.Context) *catalog.ChunkGCResult {
	l.t.Helper()
	res, err := catalog.GC(ctx, l.store(), l.dir, 0, false, 0.5)
	if err != nil {
		l.t.Fatal(err)
	}
	if res.Chunks == nil {
		return &catalog.ChunkGCResult{}
	}
	return res.Chunks
}

// TestFastDedupLocation: --dedup checkpoints of a fast-path process into a
// location directory, through the capture and the chunk store. The second
// keeps only what changed, records its block hashes in the manifest, and
// restores; its store reads nothing of the first (it names the first's
// chunks of every group that did not change), and what it adds to the
// location is the changed groups. `rm` of the earlier checkpoint and gc
// while the third runs (after the release) break nothing: gc removes
// nothing while it runs, also after its capture was aborted, and the undo
// then refills the process from the kept copy and the removed
// checkpoint's chunks; once the undo let go, gc takes them. A checkpoint
// of another process is never taken for one's own.
func TestFastDedupLocation(t *testing.T) {
	ctx := context.Background()
	tg := vramtest.Start(t, "FP_EXTRA_MB=8", "GPUCR_FAKE_POISON=1")
	l := newDedupLoc(t, tg)
	cc, c, meta := l.suspend(ctx, "one")
	if s := l.logged(); !strings.Contains(s, "went into no checkpoint of this location") {
		t.Fatalf("first checkpoint said %q", s)
	}
	one := l.commit(ctx, "one", cc, c, meta)
	if len(one.CUDA) != 1 || one.CUDA[0].Hashes == "" {
		t.Fatalf("manifest: %+v, want the process's block hashes", one.CUDA)
	}
	if _, why, err := cc.earlier.find(ctx, tg.PID+1, "one"); err != nil || !strings.Contains(why, "no block hashes of process") {
		t.Fatalf("another process's checkpoint: %q %v", why, err)
	}
	cc.earlier.end(ctx)

	// The second, committed: only the rewritten allocation kept.
	r := tg.Rewrite(t, "vmm")
	cc, c, meta = l.suspend(ctx, "two")
	v := cc.VRAM()
	if v.Kept > int64(r.Size)+2*vramtest.ZBlock || v.Reused != v.Stored-v.Kept || v.Earlier != l.dest("one").String() {
		t.Fatalf("second checkpoint: %+v, want only the %d rewritten bytes kept", v, r.Size)
	}
	if s := l.logged(); !strings.Contains(s, "unchanged since "+l.dest("one").String()) {
		t.Fatalf("second checkpoint said %q", s)
	}
	found := readBack(cc)
	if err := cc.FastWait(ctx); err != nil {
		t.Fatal(err)
	}
	if n := readBack(cc); n != found {
		t.Fatalf("the second checkpoint's store read %d bytes back from the first", n-found)
	}
	two := l.commit(ctx, "two", cc, c, meta)
	if most := int64(r.Size) + 2*int64(l.cfg.Options.ChunkSize); two.Stats.NewStoredBytes > most {
		t.Fatalf("the second checkpoint added %d bytes to the location, want at most %d (%d rewritten)", two.Stats.NewStoredBytes, most, r.Size)
	}

	// The third: rm of the earlier one and gc while it runs, then it
	// fails after the release; the undo refills from what rm left.
	tg.Rewrite(t, "pitch")
	cc, c, _ = l.suspend(ctx, "three")
	if v := cc.VRAM(); v.Reused == 0 {
		t.Fatalf("third checkpoint: %+v", v)
	}
	if _, err := catalog.Remove(ctx, store.Sub(l.store(), "two"), "two", false); err != nil {
		t.Fatal(err)
	}
	if g := l.gc(ctx); g.Removed != 0 || g.Skipped == "" {
		t.Fatalf("gc beside a capture: %+v", g)
	}
	if err := cc.FastWait(ctx); err != nil {
		t.Fatal(err)
	}
	cause := errors.New("CRIU failed")
	location.AbortCapture(ctx, c, cause)
	if g := l.gc(ctx); g.Removed != 0 || g.Skipped == "" {
		t.Fatalf("gc after the capture's abort, before its undo: %+v", g)
	}
	if err := cc.Undo(cause); !errors.Is(err, cause) {
		t.Fatalf("undo: %v", err)
	}
	tg.MustBeIntact(t)
	if g := l.gc(ctx); g.Removed == 0 {
		t.Fatalf("gc after the undo: %+v, want the removed checkpoint's own packs gone", g)
	}
	// What "one" holds is still there, whole.
	vcfg := l.cfg
	vcfg.Options.VerifyHashes = true
	src, err := location.OpenSource(ctx, l.dest("one"), vcfg, source.StreamSourceOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if _, err := source.VerifyArchive(ctx, src.(*source.ArchiveSource)); err != nil {
		t.Fatal(err)
	}
}

// TestFastDedupLocationPackGone: an earlier checkpoint whose chunks are
// not all in the location (a pack gone) is never built on: opening it
// finds that before anything is released, and the next checkpoint copies
// the process whole and says why. (Its capture then refuses to commit,
// as any does whose location's index lists the gone pack's chunks; the
// undo refills the process from its whole kept copy.)
func TestFastDedupLocationPackGone(t *testing.T) {
	ctx := context.Background()
	tg := vramtest.Start(t, "FP_EXTRA_MB=8", "GPUCR_FAKE_POISON=1")
	l := newDedupLoc(t, tg)
	cc, c, meta := l.suspend(ctx, "one")
	one := l.commit(ctx, "one", cc, c, meta)
	if err := os.Remove(filepath.Join(l.dir, one.Segments[0].Name)); err != nil {
		t.Fatal(err)
	}
	tg.Rewrite(t, "vmm")
	cc, c, meta = l.suspend(ctx, "two")
	if v := cc.VRAM(); v.Reused != 0 || v.Kept != v.Stored {
		t.Fatalf("built on a checkpoint with a pack gone: %+v", v)
	}
	if s := l.logged(); !strings.Contains(s, "no earlier checkpoint of this location is one to build on") || !strings.Contains(s, "the kept copy holds all") {
		t.Fatalf("second checkpoint said %q", s)
	}
	if err := cc.FastWait(ctx); err != nil {
		t.Fatal(err)
	}
	_, err := c.Close(ctx, *meta)
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("commit beside a gone pack: %v", err)
	}
	if err := cc.Undo(err); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("undo: %v", err)
	}
	tg.MustBeIntact(t)
}
