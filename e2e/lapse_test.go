package e2e

// A --dedup checkpoint whose lock looked stale while it waited for CRIU
// (issue 37, F4), with real CRIU: gc takes the packs it will reference,
// and the checkpoint must not exit 0 with a checkpoint that cannot be
// restored.

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/catalog"
)

// pausingCRIU writes a criu that, asked to dump, says so in dir/criu-waiting
// and waits for dir/criu-go before it runs the real one.
func pausingCRIU(t *testing.T, dir string) string {
	t.Helper()
	p := filepath.Join(dir, "criu-pausing")
	script := fmt.Sprintf(`#!/bin/sh
for a in "$@"; do
	if [ "$a" = dump ]; then
		: > %[1]s/criu-waiting
		while [ ! -e %[1]s/criu-go ]; do sleep 0.05; done
		break
	fi
done
exec %[2]s "$@"
`, dir, CRIU(t))
	if err := os.WriteFile(p, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestDedupCheckpointLockLapsed: the recipe of F4. A --dedup checkpoint of
// a process is removed; a second one of the same process waits for CRIU
// while its lock's time is set back 7 hours; gc runs (taking the capture
// for dead, it removes the first one's packs, which the second will
// reference); then CRIU dumps. The checkpoint used to exit 0, and verify
// failed on its first chunk. Now its commit refuses (the lock lapsed), so
// CRIU resumes the process, which runs on intact, and nothing is listed;
// a checkpoint that exited 0 would have to verify.
func TestDedupCheckpointLockLapsed(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	loc := filepath.Join(dir, "loc")
	tg, _ := startedTarget(ctx, t, dir, 64)
	pid := strconv.Itoa(tg.PID())
	gcsRun(ctx, t, "checkpoint", "--dedup", "--leave-running", "--pid", pid, "--to", filepath.Join(loc, "one")).ok(t, "checkpoint one")
	gcsRun(ctx, t, "rm", filepath.Join(loc, "one")).ok(t, "rm one")
	before, err := tg.Prove(ctx)
	if err != nil {
		t.Fatal(err)
	}

	criu := pausingCRIU(t, dir)
	var wg sync.WaitGroup
	var two gcsResult
	wg.Go(func() {
		two = gcsRun(ctx, t, "checkpoint", "--dedup", "--criu", criu, "--pid", pid, "--to", filepath.Join(loc, "two"))
	})
	waitForFile(ctx, t, filepath.Join(dir, "criu-waiting"))
	locks, err := filepath.Glob(filepath.Join(loc, "gpucr-chunks", "locks", "capture-*"))
	if err != nil || len(locks) != 1 {
		t.Fatalf("locks in %s: %v, %v; want the capture's", loc, locks, err)
	}
	old := time.Now().Add(-7 * time.Hour)
	if err := os.Chtimes(locks[0], old, old); err != nil {
		t.Fatal(err)
	}
	var res catalog.GCResult
	r := gcsRun(ctx, t, "gc", "--json", "--older-than", "0s", loc).ok(t, "gc")
	if err := json.Unmarshal([]byte(r.stdout), &res); err != nil || res.Chunks == nil || res.Chunks.Removed == 0 {
		t.Fatalf("gc removed no pack (%v): the recipe needs it to take the capture for dead\n%s", err, r.stdout)
	}
	if err := os.WriteFile(filepath.Join(dir, "criu-go"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	wg.Wait()

	if two.code == 0 {
		// Committed: it must restore. (It cannot, as things were.)
		gcsRun(ctx, t, "verify", filepath.Join(loc, "two")).ok(t, "verify the checkpoint that exited 0")
		return
	}
	t.Logf("checkpoint two: exit %d: %s", two.code, strings.TrimSpace(two.stderr))
	if !strings.Contains(two.stderr, "lock") {
		t.Errorf("checkpoint two failed without saying its lock lapsed:\n%s", two.stderr)
	}
	// CRIU resumed the process: it runs on, its memory intact.
	if _, err := tg.ProveAdvanced(ctx, before); err != nil {
		t.Fatalf("the process after the failed checkpoint: %v", err)
	}
	if es := lsEntries(t, gcsRun(ctx, t, "ls", "--json", loc).ok(t, "ls")); len(es) != 0 {
		t.Errorf("ls lists %v after the failed checkpoint", es)
	}
	// And a checkpoint now, with nothing stale, restores.
	gcsRun(ctx, t, "checkpoint", "--dedup", "--leave-running", "--pid", pid, "--to", filepath.Join(loc, "three")).ok(t, "checkpoint three")
	gcsRun(ctx, t, "verify", filepath.Join(loc, "three")).ok(t, "verify three")
}
