package e2e

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/hostroom/cgrouptest"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/preloadctl"
)

// TestFastPathNoRoom (issue 36): a fast-path process and `gpucr-stream
// checkpoint` in a memory cgroup whose limit cannot hold the kept copy of
// what the process wrote (the copy's tmpfs pages are charged to the
// process that writes them): the checkpoint refuses before it releases
// anything, exits 6 saying how much it needs and has, commits
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
	if code := cmd.ProcessState.ExitCode(); code != 6 {
		t.Fatalf("checkpoint refused for room: exit %d, want 6 (not enough room)\n%s", code, out)
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

// TestFastPathMarkedCache (issue 36): a process marks its KV cache as a
// cache it can rebuild (gpucr_mark_cache); a real checkpoint stores none
// of it, the restore (real CRIU) brings it back as zeros and everything
// else intact, and the marks, which live in the process's memory, are
// still there after CRIU: the library reports them.
func TestFastPathMarkedCache(t *testing.T) {
	e := setupFast(t)
	ctx := testCtx(t)
	t.Setenv("FP_MARK", "1")
	pid, tdir, waitGone := e.start(t, "m")
	ar := filepath.Join(e.dir, "ar")
	if _, err := e.gcsRun(ctx, "checkpoint", "--pid", strconv.Itoa(pid), "--to", ar, "--work-dir", filepath.Join(e.dir, "w"),
		"--criu", e.criu, "--json", "--no-progress", "--vram-files", "3"); err != nil {
		t.Fatal(err)
	}
	waitGone()
	out, err := e.gcsRun(ctx, "inspect", "--json", ar)
	if err != nil {
		t.Fatal(err)
	}
	var res struct {
		VRAM []struct{ Cached int64 } `json:"vram"`
	}
	var cached int64
	if json.Unmarshal(out, &res) == nil {
		for _, v := range res.VRAM {
			cached += v.Cached
		}
	}
	// The KV cache's written blocks: 8 of 64 KiB (fp_target.c).
	if cached != 8<<16 {
		t.Fatalf("inspect: %d bytes cached, want %d: %s", cached, 8<<16, out)
	}
	out, err = e.gcsRun(ctx, "restore", "--from", ar, "--work-dir", filepath.Join(e.dir, "w2"), "--criu", e.criu, "--json", "--no-progress")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") || !strings.HasSuffix(r, "kv=dropped") {
		t.Fatalf("after the restore: %q (%s), want the KV cache back as zeros", r, out)
	}
	p, err := preloadctl.Dial(ctx, e.sockDir, pid)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if r, err := p.Report(ctx); err != nil || r.Cached != 8<<20 || r.CacheRanges != 1 {
		t.Fatalf("report after CRIU: %+v %v, want the 8 MiB KV cache still marked", r, err)
	}
}
