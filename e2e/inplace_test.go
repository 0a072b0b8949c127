package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// startScript runs script (sh -c, after the words of wrap, which exec it)
// in a session of its own; the script touches the file "$1" names once it
// is ready, then execs what it leaves running. It returns the pid (that
// the execs keep) and a channel that receives its exit.
func startScript(ctx context.Context, t *testing.T, dir string, wrap []string, script string) (int, <-chan error) {
	t.Helper()
	ready := filepath.Join(dir, "ready")
	args := append(slices.Clone(wrap), "sh", "-c", script, "sh", ready)
	cmd := exec.CommandContext(ctx, args[0], args[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	gone := make(chan error, 1)
	go func() { gone <- cmd.Wait() }()
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
