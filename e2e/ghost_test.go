package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestCheckpointLargeGhostFile: a process holding a 33 MiB file it
// unlinked (as every NCCL rank holds its /dev/shm/nccl-* segment) failed
// CRIU's dump ("Can't dump ghost file ... increase limit"); checkpoint now
// raises --ghost-limit to it, says so, and the restored process holds the
// file's bytes again.
func TestCheckpointLargeGhostFile(t *testing.T) {
	CRIU(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := ShortTempDir(t)
	ghost := filepath.Join(dir, "segment")
	ready := filepath.Join(dir, "ready")
	script := "exec 3<>" + ghost + " && head -c 34603008 /dev/urandom >&3 && sha256sum " + ghost + " | cut -d' ' -f1 >" + ready + ".sum && rm " + ghost +
		" && touch " + ready + " && exec sleep 600"
	cmd := exec.CommandContext(ctx, "sh", "-c", script)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	gone := make(chan error, 1)
	go func() { gone <- cmd.Wait() }()
	t.Cleanup(func() { cmd.Process.Kill() })
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(ready); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the target did not get ready within 30 s")
		}
	}
	sum, err := os.ReadFile(ready + ".sum")
	if err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	archive := filepath.Join(dir, "ck")
	ck := gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(pid), "--to", archive).ok(t, "checkpoint")
	if !strings.Contains(ck.stderr, "--ghost-limit 33M") {
		t.Errorf("checkpoint did not say it raised the ghost limit:\n%s", ck.stderr)
	}
	<-gone
	r := gcsRun(ctx, t, "restore", "--from", archive)
	restored, _ := strconv.Atoi(strings.TrimSpace(r.stdout))
	if restored > 0 {
		t.Cleanup(func() {
			syscall.Kill(restored, syscall.SIGKILL)
			WaitPIDGone(ctx, restored)
		})
	}
	if r.code != 0 || restored != pid {
		t.Fatalf("restore: exit %d, printed %q (want %d):\n%s", r.code, r.stdout, pid, r.stderr)
	}
	out, err := exec.CommandContext(ctx, "sha256sum", "/proc/"+strconv.Itoa(pid)+"/fd/3").Output()
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Fields(string(out)); len(got) == 0 || got[0] != strings.TrimSpace(string(sum)) {
		t.Fatalf("the restored process's unlinked file: sha256 %q, want %s", out, sum)
	}
}
