package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/hostroom/cgrouptest"
	"github.com/gpucr/gpucr-stream/manifest"
)

// TestFastPathNoRoom (issue 36): a fast-path process and `gpucr-stream
// checkpoint` in a memory cgroup whose limit cannot hold the kept copy of
// what the process wrote (the copy's tmpfs pages are charged to the
// process that writes them): the checkpoint refuses before it releases
// anything, exits non-zero saying how much it needs and has, commits
// nothing, and the process runs on, never OOM-killed.
func TestFastPathNoRoom(t *testing.T) {
	e := setupFast(t)
	ctx := testCtx(t)
	t.Setenv("FP_EXTRA_MB", "128")
	pid, tdir, _ := e.start(t, "t")
	cg := cgrouptest.New(t, 64<<20)
	cg.Move(pid)
	ar := filepath.Join(e.dir, "ar")
	// gpucr-stream joins the cgroup itself before it runs.
	cmd := exec.CommandContext(ctx, "sh", "-c", `echo $$ > "$1/cgroup.procs" && shift && exec "$@"`, "sh", cg.Dir,
		e.gcs, "checkpoint", "--pid", strconv.Itoa(pid), "--to", ar, "--work-dir", filepath.Join(e.dir, "w"), "--criu", e.criu,
		"--no-progress", "--vram-files", "3")
	cmd.Env = e.env()
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "refused before any device memory was released") || !strings.Contains(string(out), cg.Dir) {
		t.Fatalf("checkpoint in a cgroup of 64 MiB: %v\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(ar, manifest.ManifestName)); err == nil {
		t.Fatal("a refused checkpoint committed a manifest")
	}
	// The target's own check reads its memory into buffers of its own:
	// room for those.
	cg.SetLimit(1 << 30)
	if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
		t.Fatalf("after the refusal: %q", r)
	}
	if n := cg.OOMKills(); n != 0 {
		t.Fatalf("%d OOM kills in %s", n, cg.Dir)
	}
}
