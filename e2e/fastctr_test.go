package e2e

// The GPU fast path in a runc container with its own PID namespace, the
// fake driver standing in for the GPU: the round e2e/gpu/ctr.sh runs as
// ctrfast on a real one. runc restore gives the container's init a new
// host PID (CRIU keeps its PID inside), and a restore that looked for the
// checkpoint's fast-path record by the old host PID failed ("not one of
// the restored CUDA processes", fixed by c011bab: the record's ns_pid).

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
)

// fastContainer is fp_target as the init of runc container id (state dir
// root), with its work dir tdir bound at the same path inside.
type fastContainer struct {
	runc, root, id, tdir string
	tg                   *Target // its init's host PID, followed after each restore
}

func (c *fastContainer) pid() (int, error) { return runcPID(c.runc, c.root, c.id) }

// TestFastPathContainer: fp_target, started by `gpucr-stream run --` as
// the init of a runc container (PID 1 inside), is checkpointed with
// `checkpoint --container` through the fast path and restored with
// `restore --container`, twice (the second checkpoint is of the restored
// container). Each restore gives the init a new host PID; the fast path
// must still copy its memory in, and the target reads it back intact. The
// fake driver keys its states by the PID inside (fake_cuda.c state_key),
// so that its lock holds the target in the container too.
func TestFastPathContainer(t *testing.T) {
	runc := Runtime(t, "runc")
	e := setupFast(t)
	ctx := testCtx(t)
	c := startFastContainer(ctx, t, e, runc)
	if r := fastCheck(t, c.tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
		t.Fatalf("before: %q\n%s", r, c.tg.outputTail())
	}
	for round := 1; round <= 2; round++ {
		fastContainerCycle(ctx, t, e, c, round)
	}
}

// startFastContainer runs fp_target under `gpucr-stream run --` as the
// init of a runc container and waits until it is ready.
func startFastContainer(ctx context.Context, t *testing.T, e *fastEnv, runc string) *fastContainer {
	t.Helper()
	dir := ShortTempDir(t)
	c := &fastContainer{runc: runc, root: mkdir(t, filepath.Join(dir, "runc")), tdir: mkdir(t, filepath.Join(e.dir, "ctr")),
		id: fmt.Sprintf("gcs-e2e-fast-%d", os.Getpid())}
	// The output goes to a file the container sees, opened inside: CRIU
	// dumps no descriptor of a host file outside the container's mounts.
	args := []string{"/bin/sh", "-c", `exec "$@" >>` + filepath.Join(c.tdir, "target.out") + " 2>&1", "sh",
		e.gcs, "run", "--", e.target, c.tdir}
	bundle := fastBundle(t, e, runc, mkdir(t, filepath.Join(dir, "bundle")), args)
	c.tg = startRunc(ctx, t, runc, c.root, bundle, c.id, c.tdir)
	if ns := readNSPID(t, c.tg.PID()); ns != 1 {
		t.Fatalf("the container's init %d is PID %d in its namespace, not 1: no PID namespace of its own", c.tg.PID(), ns)
	}
	return c
}

// fastContainerCycle checkpoints the container through the fast path and
// restores it, as runc's container with a new host PID, proved by the
// target.
func fastContainerCycle(ctx context.Context, t *testing.T, e *fastEnv, c *fastContainer, round int) {
	t.Helper()
	old := c.tg.PID()
	ar := filepath.Join(e.dir, fmt.Sprintf("ar-%d", round))
	out, err := e.gcsRun(ctx, "checkpoint", "--container", c.id, "--runtime-root", c.root, "--to", ar,
		"--work-dir", filepath.Join(e.dir, fmt.Sprintf("wc-%d", round)), "--criu", e.criu, "--json", "--no-progress", "--vram-files", "2")
	if err != nil {
		t.Fatalf("round %d: %v\n%s", round, err, c.tg.outputTail())
	}
	var ck phases
	if err := json.Unmarshal(out, &ck); err != nil || !ck.has("vram copy out") || !ck.has("gpu checkpoint") {
		t.Fatalf("round %d: the container's checkpoint took no fast path: %s (%v)", round, out, err)
	}
	m := archiveManifest(t, ar)
	if len(m.CUDA) != 1 || m.CUDA[0].PID != old || m.CUDA[0].NSPID != 1 || m.CUDA[0].Path != manifest.CUDAPathPreload {
		t.Fatalf("round %d: manifest cuda %+v, want the fast path's record of host PID %d, PID 1 inside", round, m.CUDA, old)
	}
	// The fake driver keeps the state under the PID inside, where the
	// target (PID 1) reads it too.
	if st := fakeCUDAState(e, 1); st != "2" {
		t.Fatalf("round %d: the fake driver's state of PID 1 inside is %q after the checkpoint, want 2 (checkpointed)", round, st)
	}
	checkpointedOut(ctx, t, c.tg, c.pid)
	out, err = e.gcsRun(ctx, "restore", "--container", c.id, "--runtime-root", c.root, "--from", ar,
		"--work-dir", filepath.Join(e.dir, fmt.Sprintf("wr-%d", round)), "--criu", e.criu, "--json", "--no-progress")
	if err != nil {
		t.Fatalf("round %d: %v\n%s", round, err, c.tg.outputTail())
	}
	c.tg.follow(t, c.pid)
	// What the round is for: the record's host PID is not the restored
	// process's.
	if c.tg.PID() == old {
		t.Fatalf("round %d: the restored init has its old host PID %d, which leaves the new-PID restore untested", round, old)
	}
	mustRestoreFast(t, out, err, c.tg.PID(), c.tdir)
	if st := fakeCUDAState(e, 1); st != "0" {
		t.Fatalf("round %d: the fake driver's state of PID 1 inside is %q after the restore, want 0 (running)", round, st)
	}
	t.Logf("round %d: init host PID %d, restored as %d (PID 1 inside)", round, old, c.tg.PID())
}

// fakeCUDAState is the fake driver's state file for key (fake_cuda.c
// state_key), "" where there is none.
func fakeCUDAState(e *fastEnv, key int) string {
	b, _ := os.ReadFile(filepath.Join(e.cudaState, strconv.Itoa(key)))
	return strings.TrimSpace(string(b))
}

// readNSPID is pid's PID in its own namespace (the last of NSpid), read
// here rather than through proc.NSPID, which the restore under test uses.
func readNSPID(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(l, "NSpid:"); ok {
			f := strings.Fields(rest)
			var n int
			if len(f) > 0 {
				fmt.Sscan(f[len(f)-1], &n)
			}
			return n
		}
	}
	t.Fatalf("no NSpid in /proc/%d/status", pid)
	return 0
}

// fastBundle writes an OCI bundle into dir running args as the
// container's init, in its own PID namespace (runc spec's default). Its
// root file system holds the host's system directories bound read-only,
// for the dynamically linked target, library and gpucr-stream, and the
// test's dir and the binaries' bound at the same paths, so that every
// path (sockets, the fake driver's states, the target's work dir) is the
// same inside and out. Each bind is not recursive: runc declares every
// spec mount to CRIU as external, and a submount it did not declare would
// fail the dump.
func fastBundle(t *testing.T, e *fastEnv, runc, dir string, args []string) string {
	t.Helper()
	rootfs := filepath.Join(dir, "rootfs")
	for _, d := range []string{"proc", "sys", "dev", "tmp"} {
		mkdir(t, filepath.Join(rootfs, d))
	}
	var mounts []any
	bind := func(p, mode string) {
		mkdir(t, filepath.Join(rootfs, p))
		mounts = append(mounts, map[string]any{"destination": p, "type": "bind", "source": p, "options": []string{"bind", mode}})
	}
	for _, p := range []string{"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"} {
		fi, err := os.Lstat(p)
		switch {
		case err != nil:
		case fi.Mode()&os.ModeSymlink != 0: // a merged /usr's /lib -> usr/lib
			target, err := os.Readlink(p)
			if err == nil {
				err = os.Symlink(target, filepath.Join(rootfs, p))
			}
			if err != nil {
				t.Fatal(err)
			}
		case fi.IsDir():
			bind(p, "ro")
		}
	}
	bind(e.dir, "rw")
	bind(filepath.Dir(e.gcs), "ro")
	runcSpec(t, runc, dir, args, append([]string{"PATH=/usr/bin:/bin"}, e.vars()...), mounts...)
	return dir
}
