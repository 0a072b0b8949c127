package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	procfs "github.com/gpucr/gpucr-stream/proc"
)

// startScript runs script (sh -c, after the words of wrap, which exec it)
// in a session of its own; the script touches the file "$1" names once it
// is ready, then execs what it leaves running. It returns the pid (that
// the execs keep) and a channel that receives its exit.
func startScript(ctx context.Context, t *testing.T, dir string, wrap []string, script string) (int, <-chan error) {
	t.Helper()
	return startScriptReapedAfter(ctx, t, dir, wrap, script, nil)
}

// startScriptReapedAfter is startScript for a parent slow to reap: the
// process's exit is reaped only once reap is closed (or ctx ends); nil
// reaps at once.
func startScriptReapedAfter(ctx context.Context, t *testing.T, dir string, wrap []string, script string, reap <-chan struct{}) (int, <-chan error) {
	t.Helper()
	ready := filepath.Join(dir, "ready")
	args := append(slices.Clone(wrap), "sh", "-c", script, "sh", ready)
	cmd := exec.CommandContext(ctx, args[0], args[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	gone := make(chan error, 1)
	go func() {
		if reap != nil {
			select {
			case <-reap:
			case <-ctx.Done():
			}
		}
		gone <- cmd.Wait()
	}()
	t.Cleanup(func() { cmd.Process.Kill() })
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(ready); err == nil {
			return cmd.Process.Pid, gone
		}
		if time.Now().After(deadline) {
			t.Fatal("the target did not get ready within 30 s")
		}
	}
}

// restoreInPlace runs restore --from archive and checks that it printed
// pid (restored under its own PID); the restored process is killed at the
// end of the test. It returns the command's result.
func restoreInPlace(ctx context.Context, t *testing.T, archive string, pid int) gcsResult {
	t.Helper()
	r := gcsRun(ctx, t, "restore", "--from", archive)
	restored, _ := strconv.Atoi(strings.TrimSpace(r.stdout))
	if restored > 0 {
		t.Cleanup(func() {
			syscall.Kill(restored, syscall.SIGKILL)
			WaitPIDGone(ctx, restored)
		})
	}
	if r.code != 0 || restored != pid {
		t.Fatalf("restore in place: exit %d, printed %q (want %d):\n%s", r.code, r.stdout, pid, r.stderr)
	}
	return r
}

// TestCheckpointBeforeReap: a checkpoint returns once CRIU's kill took,
// not once the parent reaps the process (a restored process's parent is
// PID 1, which on the GPU machine reaped 1.5-1.9 s later, all of it in
// every second checkpoint's time), and a restore right after waits for
// the reap instead of failing on a PID still taken.
func TestCheckpointBeforeReap(t *testing.T) {
	CRIU(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := ShortTempDir(t)
	release := make(chan struct{})
	pid, _ := startScriptReapedAfter(ctx, t, dir, nil, `touch "$1" && exec sleep 600`, release)
	archive := filepath.Join(dir, "ck")
	start := time.Now()
	ck := gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(pid), "--to", archive)
	took := time.Since(start)
	dead := procfs.Dead([]int{pid})
	go func() {
		time.Sleep(time.Second)
		close(release)
	}()
	ck.ok(t, "checkpoint")
	// Waiting for the reap would wait the whole checkpoint.GoneTimeout (10 s)
	// here, the reap coming only after the checkpoint returned.
	if len(dead) != 1 || took > 5*time.Second {
		t.Fatalf("checkpoint returned with process %d not just dead but unreaped, or after %v: dead %v", pid, took.Round(time.Millisecond), dead)
	}
	r := gcsRun(ctx, t, "restore", "--from", archive, "--json")
	var res struct {
		PID    int `json:"pid"`
		Phases []struct {
			Name string  `json:"name"`
			Secs float64 `json:"seconds"`
		} `json:"phases"`
	}
	json.Unmarshal([]byte(r.stdout), &res)
	if res.PID > 0 {
		t.Cleanup(func() {
			syscall.Kill(res.PID, syscall.SIGKILL)
			WaitPIDGone(ctx, res.PID)
		})
	}
	if r.code != 0 || res.PID != pid {
		t.Fatalf("restore right after the checkpoint: exit %d, pid %d (want %d):\n%s", r.code, res.PID, pid, r.stderr)
	}
	waited := -1.0
	for _, p := range res.Phases {
		if p.Name == "wait for the checkpointed PIDs to be reaped" {
			waited = p.Secs
		}
	}
	if waited <= 0 {
		t.Fatalf("restore did not say it waited for PID %d to be reaped: phases %+v", pid, res.Phases)
	}
}
