package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestRestoreInPlaceTimeWait: a process whose listener (without
// SO_REUSEADDR, as NCCL's bootstrap listeners) left a TIME_WAIT socket on
// its port is checkpointed, killed, and restored in place at once. CRIU's
// bind of the listener failed with "Address already in use" for up to a
// minute (issue 24: the NCCL pair's restore); restore now clears that
// TIME_WAIT socket first and says so.
func TestRestoreInPlaceTimeWait(t *testing.T) {
	CRIU(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := ShortTempDir(t)
	tg := StartTarget(t, filepath.Join(dir, "target"), 16, "--listen-timewait")
	b, err := os.ReadFile(filepath.Join(dir, "target", "listen-port"))
	if err != nil {
		t.Fatal(err)
	}
	port := strings.TrimSpace(string(b))
	before, err := tg.Prove(ctx)
	if err != nil {
		t.Fatalf("proof before: %v", err)
	}
	archive := filepath.Join(dir, "ck")
	gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", archive).ok(t, "checkpoint")
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatal(err)
	}
	r := restoreInPlace(ctx, t, archive, tg.PID())
	if !strings.Contains(r.stderr, "TIME_WAIT sockets on ports ["+port+"]") {
		t.Errorf("restore did not say it cleared the TIME_WAIT socket on port %s:\n%s", port, r.stderr)
	}
	provenRestore(ctx, t, tg, before)
}
