package e2e

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// TestRestoreWaitsForPIDs: a restore on the host of the checkpoint waits
// for the PIDs it must reuse. The target's child, orphaned by CRIU's kill,
// stays a zombie of this test (its subreaper) until the restore, from a
// stream, says it waits for a PID: then it is reaped, and the restore goes
// on and brings the target back. A PID that stays taken (the checkpoint
// was taken with --leave-running) fails the restore, naming the PID and
// the process that holds it, and the process runs on.
func TestRestoreWaitsForPIDs(t *testing.T) {
	criu := CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 64)
	bin := BuildBinary(t, "./cmd/gpucr-stream")
	ck := gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--criu", criu, "--no-progress").ok(t, "checkpoint")
	stream := filepath.Join(dir, "ck.stream")
	if err := os.WriteFile(stream, []byte(ck.stdout), 0o600); err != nil {
		t.Fatal(err)
	}
	if !pidExists(tg.ChildPID()) {
		t.Fatalf("the target's child %d was reaped by someone else: nothing to wait for", tg.ChildPID())
	}

	in, err := os.Open(stream)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	cmd := exec.CommandContext(ctx, bin, "restore", "--from", "-", "--criu", criu, "--no-progress")
	cmd.Stdin = in
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	errPipe, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	var waited bool
	var wg sync.WaitGroup
	wg.Go(func() {
		sc := bufio.NewScanner(errPipe)
		for sc.Scan() {
			stderr.WriteString(sc.Text() + "\n")
			if strings.Contains(sc.Text(), "restore waits up to") && !waited {
				waited = true
				if err := WaitPIDGone(ctx, tg.ChildPID()); err != nil {
					t.Error(err)
				}
			}
		}
	})
	wg.Wait()
	err = cmd.Wait()
	t.Logf("restore: %v\nstderr:\n%s", err, stderr.String())
	if err != nil {
		t.Fatalf("restore failed: %v", err)
	}
	if !waited {
		t.Fatal("the restore never said it waited for a PID")
	}
	if pid, err := strconv.Atoi(strings.TrimSpace(stdout.String())); err != nil || pid != tg.PID() {
		t.Fatalf("restore printed %q, want the PID %d", stdout.String(), tg.PID())
	}
	provenRestore(ctx, t, tg, before)

	// Its PIDs taken for good: the checkpointed process still runs.
	archive := filepath.Join(dir, "ck-running")
	gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", archive, "--leave-running", "--criu", criu, "--no-progress").ok(t, "checkpoint --leave-running")
	r := gcsRun(ctx, t, "restore", "--from", archive, "--criu", criu, "--no-progress")
	t.Logf("restore over a running process:\n%s", r.stderr)
	says := fmt.Sprintf("PID %d by process %d \"", tg.PID(), tg.PID())
	if r.code == 0 || !strings.Contains(r.stderr, says) || !strings.Contains(r.stderr, "e2e-target") || strings.Contains(r.stderr, "Can't fork") {
		t.Fatalf("restore over a running process: exit %d, want a failure naming %q and its command:\n%s", r.code, says, r.stderr)
	}
	last, err := tg.Prove(ctx)
	if err != nil {
		t.Fatal(err)
	}
	tg.ProveIntact(ctx, t, &last)
}
