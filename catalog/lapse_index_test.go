package catalog

import (
	"context"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/store/storetest"
)

// TestLapsedCaptureIndex: a --dedup capture whose lock lapsed, and whose
// packs gc took meanwhile, refuses to commit and leaves no index object
// naming them. It used to write one before its commit's proof failed:
// check then found the index damaged whatever gc ran, and every later
// capture of those chunks referenced packs that were gone and failed to
// commit (found by the torture test, e2e/torture_test.go).
func TestLapsedCaptureIndex(t *testing.T) {
	for kind, newStore := range liveStores(t) {
		t.Run(kind, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			loc := storetest.Skew(newStore(t).st, 0)
			files := map[string][]byte{"pages-1.img": noise(3<<20, 54)}
			c := startCapture(ctx, t, loc, "one", true, 1<<20, files)
			waitFor(ctx, t, "a pack committed", func() bool {
				packs, err := loc.List(ctx, chunkstore.PackPrefix)
				return err == nil && len(packs) > 0
			})
			locks, err := loc.List(ctx, chunkstore.LockPrefix)
			if err != nil || len(locks) != 1 {
				t.Fatalf("locks: %v, %v; want the capture's", locks, err)
			}
			loc.Backdate(locks[0].Name, 7*time.Hour)
			// The chunk store's part of gc only: the packs the capture
			// committed go, the one it writes stays.
			res, err := GCChunks(ctx, loc, 0, false, 0)
			if err != nil {
				t.Fatal(err)
			}
			if res.Removed == 0 {
				t.Fatalf("gc removed no pack (%+v): the test needs it to take the capture's", res)
			}
			mustRefuse(ctx, t, c, loc, "one", files, "lock")
			if _, err := GC(ctx, loc, "loc", 0, false, 0); err != nil {
				t.Fatal(err)
			}
			rep, err := Check(ctx, loc, CheckOptions{})
			if err != nil || !rep.OK {
				t.Fatalf("check after a lapsed capture and gc: %+v, %v", rep, err)
			}
			mustCommit(ctx, t, startCapture(ctx, t, loc, "two", true, 1<<20, files), loc, "two", files)
		})
	}
}
