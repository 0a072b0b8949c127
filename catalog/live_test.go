package catalog

// gc against captures in flight (issue 37, findings F3, F4 and F9): a
// capture exits 0 only with a checkpoint that restores, whatever gc did
// meanwhile, whatever the clocks say. Each runs on a directory and on
// MinIO.

import (
	"bytes"
	"context"
	"io/fs"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/storetest"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/testwait"
)

// liveStore is a location of one kind for these tests, and what shows
// a write in flight there.
type liveStore struct {
	st store.Store
	// inFlight says a write has begun and is not committed: a temporary
	// file, an incomplete upload.
	inFlight func(ctx context.Context) bool
}

// liveStores are a directory and an S3 prefix on MinIO, each new.
func liveStores(t *testing.T) map[string]func(t *testing.T) liveStore {
	return map[string]func(t *testing.T) liveStore{
		"dir": func(t *testing.T) liveStore {
			root := t.TempDir()
			return liveStore{st: dir.New(root), inFlight: func(context.Context) bool {
				found := false
				filepath.WalkDir(root, func(p string, e fs.DirEntry, err error) error {
					found = found || (err == nil && strings.Contains(e.Name(), ".tmp-"))
					return nil
				})
				return found
			}}
		},
		"s3": func(t *testing.T) liveStore {
			srv := minio(t)
			client := srv.Client(t)
			return liveStore{st: s3At(t, srv, "loc"), inFlight: func(ctx context.Context) bool {
				for u := range client.ListIncompleteUploads(ctx, "dedup", "", true) {
					if u.Err == nil {
						return true
					}
				}
				return false
			}}
		},
	}
}

// waitFor polls cond until it holds, or fails the test when ctx ends.
func waitFor(ctx context.Context, t *testing.T, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v", what, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// startCapture opens a capture into the checkpoint name of loc (into its
// chunk store when dedup) and writes files into it; Close commits it.
func startCapture(ctx context.Context, t *testing.T, loc store.Store, name string, dedup bool, segmentSize int64, files map[string][]byte) *streamer.Capture {
	t.Helper()
	var out streamer.Output
	var err error
	if dedup {
		out, err = streamer.NewDedupOutput(ctx, store.Sub(loc, name), loc, segmentSize, nil)
	} else {
		out, err = streamer.NewArchiveOutput(ctx, store.Sub(loc, name), segmentSize)
	}
	if err != nil {
		t.Fatal(err)
	}
	// One segment or pack at a time, as into S3: its bytes go to one
	// upload.
	out.(interface{ SetLanes(int) }).SetLanes(1)
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: 256 << 10, Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	for n, b := range files {
		if _, err := c.WriteFile(n, bytes.NewReader(b), false); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// mustCommit closes c, which must commit a checkpoint of want that
// verifies.
func mustCommit(ctx context.Context, t *testing.T, c *streamer.Capture, loc store.Store, name string, want map[string][]byte) {
	t.Helper()
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		t.Fatalf("the capture failed: %v", err)
	}
	verifyIn(t, store.Sub(loc, name), want)
}

// mustRefuse closes c, whose commit must fail saying why, leaving no
// checkpoint listed; one that commits must at least verify.
func mustRefuse(ctx context.Context, t *testing.T, c *streamer.Capture, loc store.Store, name string, want map[string][]byte, why string) {
	t.Helper()
	_, err := c.Close(ctx, manifest.Manifest{})
	if err == nil {
		verifyIn(t, store.Sub(loc, name), want)
		t.Fatal("the capture committed")
	}
	if !strings.Contains(err.Error(), why) {
		t.Fatalf("the capture failed, not saying %q: %v", why, err)
	}
	es, lerr := List(ctx, loc, "loc")
	if lerr != nil {
		t.Fatal(lerr)
	}
	for _, e := range es {
		if e.Name == name {
			t.Fatalf("the capture failed (%v), and ls lists %s", err, name)
		}
	}
	t.Logf("refused: %v", err)
}

// TestGCLeavesRunningCapture (F3): a plain capture whose segments are
// older than --older-than, by the store's clock or by a host's, holds a
// fresh lock: gc leaves it whole, and it commits a checkpoint that
// verifies. It used to be judged unfinished by its segments' age: gc
// removed them, and the capture still exited 0.
func TestGCLeavesRunningCapture(t *testing.T) {
	cases := []struct {
		name string
		skew time.Duration // the store's clock against the hosts'
		age  time.Duration
	}{
		{"older than 0s", 0, 0},
		{"store 2h behind, older than 1h", -2 * time.Hour, time.Hour},
		{"store 2h ahead, older than 1h", 2 * time.Hour, time.Hour},
	}
	for kind, newStore := range liveStores(t) {
		for _, tc := range cases {
			t.Run(kind+"/"+tc.name, func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
				defer cancel()
				loc := storetest.Skew(newStore(t).st, tc.skew)
				files := map[string][]byte{"pages-1.img": noise(3<<20, 51)}
				c := startCapture(ctx, t, loc, "job", false, 1<<20, files)
				waitFor(ctx, t, "a committed segment", func() bool {
					objs, _ := loc.List(ctx, "job/"+manifest.SegmentPrefix)
					for _, o := range objs {
						if strings.HasSuffix(o.Name, ".gcs") {
							return true
						}
					}
					return false
				})
				res, err := GC(ctx, loc, "loc", tc.age, false, 0)
				if err != nil {
					t.Fatal(err)
				}
				if res.Objects != 0 {
					t.Errorf("gc removed %d objects (%v) of a running capture", res.Objects, res.Unfinished)
				}
				mustCommit(ctx, t, c, loc, "job", files)
			})
		}
	}
}

// TestGCLapsedDedupCapture (F4): a --dedup capture whose lock looked
// stale (its time set back 7 hours, as of a capture stopped that long)
// lets gc take the packs it references; its commit then refuses, saying
// its lock lapsed, and nothing is listed. It used to commit and exit 0,
// and the restore failed.
func TestGCLapsedDedupCapture(t *testing.T) {
	for kind, newStore := range liveStores(t) {
		t.Run(kind, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
			defer cancel()
			loc := storetest.Skew(newStore(t).st, 0)
			files := map[string][]byte{"pages-1.img": noise(2<<20, 52)}
			if _, err := dedupIn(ctx, loc, "one", files); err != nil {
				t.Fatal(err)
			}
			if _, err := Remove(ctx, store.Sub(loc, "one"), "one", false); err != nil {
				t.Fatal(err)
			}
			c := startCapture(ctx, t, loc, "two", true, 1<<20, nil)
			locks, err := loc.List(ctx, chunkstore.LockPrefix)
			if err != nil || len(locks) != 1 {
				t.Fatalf("locks: %v, %v; want the capture's", locks, err)
			}
			loc.Backdate(locks[0].Name, 7*time.Hour)
			res, err := GC(ctx, loc, "loc", 0, false, 0)
			if err != nil {
				t.Fatal(err)
			}
			if res.Chunks == nil || res.Chunks.Removed == 0 {
				t.Fatalf("gc removed no pack (%+v): the test needs it to take the capture for dead", res.Chunks)
			}
			for n, b := range files {
				if _, err := c.WriteFile(n, bytes.NewReader(b), false); err != nil {
					t.Fatal(err)
				}
			}
			mustRefuse(ctx, t, c, loc, "two", files, "lock")
		})
	}
}

// TestGCStoreClockBehind: a store whose clock is 7 hours behind the hosts'
// (or hosts ahead of it) makes no lock look stale, since locks are judged
// by the store's clock: gc leaves the packs a --dedup capture in flight
// references, and the capture commits a checkpoint that verifies. Judged
// by the host's clock, every lock was stale.
func TestGCStoreClockBehind(t *testing.T) {
	for kind, newStore := range liveStores(t) {
		t.Run(kind, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
			defer cancel()
			loc := storetest.Skew(newStore(t).st, -7*time.Hour)
			files := map[string][]byte{"pages-1.img": noise(2<<20, 53)}
			if _, err := dedupIn(ctx, loc, "one", files); err != nil {
				t.Fatal(err)
			}
			if _, err := Remove(ctx, store.Sub(loc, "one"), "one", false); err != nil {
				t.Fatal(err)
			}
			c := startCapture(ctx, t, loc, "two", true, 1<<20, files)
			res, err := GC(ctx, loc, "loc", time.Hour, false, 0)
			if err != nil {
				t.Fatal(err)
			}
			if res.Chunks == nil || res.Chunks.Skipped == "" {
				t.Errorf("gc of the chunk store with a capture in flight: %+v", res.Chunks)
			}
			mustCommit(ctx, t, c, loc, "two", files)
		})
	}
}

// TestGCLeavesCaptureAcrossHours: a --dedup capture that waits 7 hours of
// the store's clock keeps its lock fresh (a refresh each hour here): gc
// then leaves its packs, and it commits.
func TestGCLeavesCaptureAcrossHours(t *testing.T) {
	defer func(every time.Duration) { store.LockRefresh = every }(store.LockRefresh)
	store.LockRefresh = 5 * time.Millisecond
	for kind, newStore := range liveStores(t) {
		t.Run(kind, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
			defer cancel()
			loc := storetest.Skew(newStore(t).st, 0)
			files := map[string][]byte{"pages-1.img": noise(2<<20, 54)}
			if _, err := dedupIn(ctx, loc, "one", files); err != nil {
				t.Fatal(err)
			}
			if _, err := Remove(ctx, store.Sub(loc, "one"), "one", false); err != nil {
				t.Fatal(err)
			}
			c := startCapture(ctx, t, loc, "two", true, 1<<20, nil)
			locks, err := loc.List(ctx, chunkstore.LockPrefix)
			if err != nil || len(locks) != 1 {
				t.Fatalf("locks: %v, %v; want the capture's", locks, err)
			}
			for range 7 {
				loc.Advance(time.Hour)
				n, _ := loc.Commits(locks[0].Name)
				if !loc.WaitCommit(ctx, locks[0].Name, n) {
					t.Fatal("the capture's lock was not refreshed")
				}
			}
			res, err := GC(ctx, loc, "loc", 0, false, 0)
			if err != nil {
				t.Fatal(err)
			}
			if res.Chunks == nil || res.Chunks.Skipped == "" {
				t.Errorf("gc of the chunk store with a capture in flight: %+v", res.Chunks)
			}
			for n, b := range files {
				if _, err := c.WriteFile(n, bytes.NewReader(b), false); err != nil {
					t.Fatal(err)
				}
			}
			mustCommit(ctx, t, c, loc, "two", files)
		})
	}
}

// TestGCAtZeroLeavesWritesInFlight (F9): gc --older-than 0s removes no
// temporary file and aborts no upload of a capture in flight, plain or
// --dedup: the capture commits a checkpoint that verifies. They used to
// go, and the capture failed.
func TestGCAtZeroLeavesWritesInFlight(t *testing.T) {
	for kind, newStore := range liveStores(t) {
		for _, dedup := range []bool{false, true} {
			name := kind + "/plain"
			if dedup {
				name = kind + "/dedup"
			}
			t.Run(name, func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
				defer cancel()
				ls := newStore(t)
				// More than an S3 part (5 MiB here) into a segment or
				// pack of 64 MiB: an upload begun, not completed.
				files := map[string][]byte{"pages-1.img": noise(7<<20, 55)}
				c := startCapture(ctx, t, ls.st, "job", dedup, 64<<20, files)
				waitFor(ctx, t, "a write in flight", func() bool { return ls.inFlight(ctx) })
				res, err := GC(ctx, ls.st, "loc", 0, false, 0)
				if err != nil {
					t.Fatal(err)
				}
				if res.TempFiles+res.Uploads+res.Objects != 0 {
					t.Errorf("gc removed %d temporary files, %d uploads and %d objects of a capture in flight", res.TempFiles, res.Uploads, res.Objects)
				}
				if !ls.inFlight(ctx) {
					t.Error("the write in flight is gone")
				}
				mustCommit(ctx, t, c, ls.st, "job", files)
			})
		}
	}
}

// pauseAt is a store whose Create of one name waits, once, until resumed.
type pauseAt struct {
	store.Store
	name    string
	once    sync.Once
	reached chan struct{}
	resume  chan struct{}
}

func (p *pauseAt) Create(ctx context.Context, name string) (store.ObjectWriter, error) {
	if name == p.name {
		p.once.Do(func() {
			close(p.reached)
			<-p.resume
		})
	}
	return p.Store.Create(ctx, name)
}

// TestGCLeavesCopyInFlight: a plain cp holds a lock beside the segments it
// copies: gc --older-than 0s, run once they are copied and verified and
// before the manifest names them, leaves them, and the copy verifies.
func TestGCLeavesCopyInFlight(t *testing.T) {
	for kind, newStore := range liveStores(t) {
		t.Run(kind, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
			defer cancel()
			loc := newStore(t).st
			files := map[string][]byte{"pages-1.img": noise(3<<20, 56)}
			mustCommit(ctx, t, startCapture(ctx, t, loc, "src", false, 1<<20, files), loc, "src", files)
			dst := &pauseAt{Store: store.Sub(loc, "copy"), name: manifest.ManifestName, reached: make(chan struct{}), resume: make(chan struct{})}
			done := make(chan error, 1)
			go func() {
				_, err := Copy(ctx, store.Sub(loc, "src"), dst, pipeline.Options{}, nil)
				done <- err
			}()
			select {
			case <-dst.reached:
			case err := <-done:
				t.Fatalf("cp ended before its manifest: %v", err)
			}
			res, err := GC(ctx, loc, "loc", 0, false, 0)
			close(dst.resume)
			if err != nil {
				t.Fatal(err)
			}
			if res.Objects != 0 {
				t.Errorf("gc removed %d objects (%v) of a cp in flight", res.Objects, res.Unfinished)
			}
			if err := <-done; err != nil {
				t.Fatalf("cp: %v", err)
			}
			verifyIn(t, store.Sub(loc, "copy"), files)
		})
	}
}
