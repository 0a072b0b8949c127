package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
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
	script := "exec 3<>" + ghost + " && head -c 34603008 /dev/urandom >&3 && sha256sum " + ghost + " | cut -d' ' -f1 >\"$1.sum\" && rm " + ghost +
		" && touch \"$1\" && exec sleep 600"
	pid, gone := startScript(ctx, t, dir, nil, script)
	sum, err := os.ReadFile(filepath.Join(dir, "ready.sum"))
	if err != nil {
		t.Fatal(err)
	}
	archive := filepath.Join(dir, "ck")
	ck := gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(pid), "--to", archive).ok(t, "checkpoint")
	if !strings.Contains(ck.stderr, "--ghost-limit 33M") {
		t.Errorf("checkpoint did not say it raised the ghost limit:\n%s", ck.stderr)
	}
	<-gone
	restoreInPlace(ctx, t, archive, pid)
	out, err := exec.CommandContext(ctx, "sha256sum", "/proc/"+strconv.Itoa(pid)+"/fd/3").Output()
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Fields(string(out)); len(got) == 0 || got[0] != strings.TrimSpace(string(sum)) {
		t.Fatalf("the restored process's unlinked file: sha256 %q, want %s", out, sum)
	}
}
