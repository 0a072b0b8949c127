package e2e

// What a new user met in the first hour, with real CRIU.

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestCheckpointThenRestoreAtOnce: checkpoint returns only once the dumped
// tree is gone, so a restore right after it (no wait of the caller's own)
// gets its PIDs.
func TestCheckpointThenRestoreAtOnce(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 64)
	archive := filepath.Join(dir, "ck")
	// The target is this test's child: reap it when it dies, as a shell
	// reaps its jobs, while checkpoint runs.
	reaped := make(chan error, 1)
	go func() { reaped <- tg.WaitGone(ctx) }()
	start := time.Now()
	ck := gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", archive).ok(t, "checkpoint")
	if !strings.Contains(ck.stderr, "--cuda auto: no process of the tree") {
		t.Errorf("checkpoint does not say that --cuda auto found no CUDA process:\n%s", ck.stderr)
	}
	if took := time.Since(start); took > 8*time.Second {
		t.Errorf("checkpoint took %v: it waited for a reaped process", took)
	}
	r := gcsRun(ctx, t, "restore", "--from", archive).ok(t, "restore right after checkpoint")
	if err := <-reaped; err != nil {
		t.Fatal(err)
	}
	if pid, err := strconv.Atoi(strings.TrimSpace(r.stdout)); err != nil || pid != tg.PID() {
		t.Fatalf("restore printed %q, want the PID %d", r.stdout, tg.PID())
	}
	provenRestore(ctx, t, tg, before)
	tg.Kill()

	// ls and inspect name the process that was checkpointed.
	insp := gcsRun(ctx, t, "inspect", archive).ok(t, "inspect")
	if !strings.Contains(insp.stdout, fmt.Sprintf("process     %d: ", tg.PID())) {
		t.Errorf("inspect does not name process %d:\n%s", tg.PID(), insp.stdout)
	}
}

// TestFailedCheckpointKeepsLog: a process with a controlling terminal is
// refused by CRIU without --shell-job; the process runs on, the error says
// to pass --criu-opts --shell-job and where CRIU's log is, and the log is
// there.
func TestFailedCheckpointKeepsLog(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	tty := openTTY(t)
	cmd := exec.Command("sleep", "300")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	dir := ShortTempDir(t)
	r := gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(cmd.Process.Pid), "--to", filepath.Join(dir, "ck"))
	if r.code == 0 {
		t.Fatal("checkpoint of a process on a terminal succeeded without --shell-job")
	}
	if !strings.Contains(r.stderr, "--criu-opts --shell-job") {
		t.Errorf("no --criu-opts --shell-job hint:\n%s", r.stderr)
	}
	m := regexp.MustCompile(`criu's log is kept in (\S+);`).FindStringSubmatch(r.stderr)
	if m == nil {
		t.Fatalf("the error does not say where CRIU's log is:\n%s", r.stderr)
	}
	t.Cleanup(func() { os.RemoveAll(m[1]) })
	if _, err := os.Stat(filepath.Join(m[1], "img", "dump.log")); err != nil {
		t.Errorf("CRIU's log is not where the error says: %v", err)
	}
	time.Sleep(100 * time.Millisecond)
	if err := syscall.Kill(cmd.Process.Pid, 0); err != nil {
		t.Errorf("the process did not survive the failed checkpoint: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "ck", "segments")); err == nil {
		t.Error("the failed checkpoint left a segments/ directory")
	}
}

// openTTY returns the terminal side of a new pseudo-terminal.
func openTTY(t *testing.T) *os.File {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	s, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}
