package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/testwait"
)

// The GPU fast path end to end, without a GPU: a program that reaches a fake
// CUDA driver (preload/testdata/fake_cuda.c: host memory behind the
// driver's entry points, and a process checkpoint API that moves nothing)
// the way the CUDA runtime does, started with `gpucr-stream run`, is
// checkpointed by `gpucr-stream checkpoint` with real CRIU and restored.
// The program reads its memory back through its own pointers afterwards:
// same addresses, same bytes, and its kernel thread's device counter equal
// to its launches.

type fastEnv struct {
	gcs, criu, dir, fakeLib, target, sockDir string
	// cudaState holds the fake driver's process states (GPUCR_FAKE_CUDA_STATE):
	// they outlive a killed gpucr-stream, and the target's calls while
	// locked are recorded in its violation file.
	cudaState string
}

func setupFast(t *testing.T) *fastEnv {
	t.Helper()
	criu := CRIU(t)
	cc, err := exec.LookPath("cc")
	if err != nil {
		missing(t, "no C compiler (cc) for the fast-path library and its fake driver")
	}
	gcs := BuildBinary(t, "./cmd/gpucr-stream")
	root := ModuleRoot(t)
	dir := ShortTempDir(t)
	e := &fastEnv{gcs: gcs, criu: criu, dir: dir, fakeLib: filepath.Join(dir, "lib", "libcuda.so.1"),
		target: filepath.Join(dir, "fp_target"), sockDir: filepath.Join(dir, "run"), cudaState: filepath.Join(dir, "cudastate")}
	for _, d := range []string{filepath.Dir(e.fakeLib), e.cudaState} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		if b, err := os.ReadFile(filepath.Join(e.cudaState, "violation")); err == nil {
			t.Errorf("the target called the driver while it was locked:\n%s", b)
		}
	})
	// `run` finds the library next to the binary.
	lib := filepath.Join(filepath.Dir(gcs), "libgpucr-preload.so")
	libSrc, _ := filepath.Glob(filepath.Join(root, "preload", "*.c")) // the library's files
	for _, s := range [][]string{
		{cc, "-O2", "-fPIC", "-shared", "-o", e.fakeLib, filepath.Join(root, "preload", "testdata", "fake_cuda.c")},
		{cc, "-O2", "-o", e.target, filepath.Join(root, "preload", "testdata", "fp_target.c"), "-ldl", "-lpthread"},
		append(append([]string{cc, "-O2", "-fPIC", "-shared", "-o", lib}, libSrc...), "-ldl", "-lpthread"),
	} {
		if out, err := exec.Command(s[0], s[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v\n%s", s, err, out)
		}
	}
	return e
}

func (e *fastEnv) env() []string { return append(os.Environ(), e.vars()...) }

// vars is what the fast path and the fake driver need in the environment,
// on both sides (a container's process gets these alone).
func (e *fastEnv) vars() []string {
	return []string{"GPUCR_PRELOAD_DIR=" + e.sockDir, "GPUCR_LIBCUDA=" + e.fakeLib, "LD_LIBRARY_PATH=" + filepath.Dir(e.fakeLib),
		"GPUCR_FAKE_CUDA_STATE=" + e.cudaState}
}

// start runs the target under `gpucr-stream run` in its own session, as
// CRIU wants it (stdin /dev/null, output to a file).
func (e *fastEnv) start(t *testing.T, name string) (pid int, tdir string, wait func()) {
	t.Helper()
	tdir = filepath.Join(e.dir, name)
	pid, wait = e.startCmd(t, tdir, e.target, tdir)
	return pid, tdir, wait
}

// startCmd runs args under `gpucr-stream run` as start does, and waits
// for tdir/ready; wait waits for its end.
func (e *fastEnv) startCmd(t *testing.T, tdir string, args ...string) (pid int, wait func()) {
	t.Helper()
	if err := os.MkdirAll(tdir, 0o755); err != nil {
		t.Fatal(err)
	}
	out, err := os.Create(filepath.Join(tdir, "out"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	cmd := exec.Command(e.gcs, append([]string{"run", "--"}, args...)...)
	cmd.Env = e.env()
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-done })
	deadline := time.Now().Add(testwait.Scale(10 * time.Second))
	for !fileExists(filepath.Join(tdir, "ready")) {
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(tdir, "out"))
			t.Fatalf("target not ready: %s", b)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return cmd.Process.Pid, func() { <-done }
}

// archiveManifest is the manifest of the archive directory ar.
func archiveManifest(t *testing.T, ar string) *manifest.Manifest {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(ar, manifest.ManifestName))
	if err != nil {
		t.Fatal(err)
	}
	m, err := manifest.Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// check asks the target to read its memory back.
func fastCheck(t *testing.T, tdir string, wait time.Duration) string {
	t.Helper()
	res := filepath.Join(tdir, "result")
	os.Remove(res)
	if err := os.WriteFile(filepath.Join(tdir, "check"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(testwait.Scale(wait)); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if b, err := os.ReadFile(res); err == nil {
			return strings.TrimSpace(string(b))
		}
	}
	return ""
}

// runPaused starts gpucr-stream, the build with test hooks, with
// GPUCR_TEST_PAUSE=step (package testhook) and returns once it stopped
// there; kill ends it with SIGKILL. It fails the test if the command ends,
// or does not get there in 20 s, first.
func (e *fastEnv) runPaused(ctx context.Context, t *testing.T, step string, args ...string) (kill func()) {
	t.Helper()
	marker := filepath.Join(t.TempDir(), "paused")
	cmd := exec.CommandContext(ctx, HooksBinary(t), args...)
	cmd.Env = append(e.env(), "GPUCR_TEST_PAUSE="+step+":"+marker)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	kill = func() {
		cmd.Process.Kill() // SIGKILL
		<-exited
	}
	for end := time.Now().Add(20 * time.Second); !fileExists(marker); time.Sleep(10 * time.Millisecond) {
		select {
		case <-exited:
			t.Fatalf("gpucr-stream %s ended before %s: %s", args[0], step, stderr.String())
		default:
		}
		if time.Now().After(end) {
			kill()
			t.Fatalf("gpucr-stream %s never reached %s: %s", args[0], step, stderr.String())
		}
	}
	return kill
}

// mustRestoreFast checks a restore's result (out, err of `restore --json`):
// it brought pid back through the fast path's copy in, and the program
// proves its memory.
func mustRestoreFast(t *testing.T, out []byte, err error, pid int, tdir string) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	var rs phases
	if err := json.Unmarshal(out, &rs); err != nil || !rs.has("vram copy in") || rs.PID != pid {
		t.Fatalf("restore: %s (%v)", out, err)
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
		t.Fatalf("after restore: %q", r)
	}
}

func (e *fastEnv) gcsRun(ctx context.Context, args ...string) ([]byte, error) {
	return e.gcsRunEnv(ctx, nil, args...)
}

// gcsRunEnv runs gpucr-stream with env added to e.env().
func (e *fastEnv) gcsRunEnv(ctx context.Context, env []string, args ...string) ([]byte, error) {
	out, _, err := e.gcsRunStderr(ctx, env, args...)
	return out, err
}

// gcsRunStderr is gcsRunEnv that returns what gpucr-stream said on stderr
// too. e.gcs has no test hooks: env that asks for one is the test's
// mistake (run HooksBinary through runBin), not a fault that never came.
func (e *fastEnv) gcsRunStderr(ctx context.Context, env []string, args ...string) ([]byte, string, error) {
	for _, kv := range env {
		if strings.HasPrefix(kv, "GPUCR_TEST_FAULT=") || strings.HasPrefix(kv, "GPUCR_TEST_PAUSE=") {
			return nil, "", fmt.Errorf("%s asks for a test hook, which only HooksBinary has", kv)
		}
	}
	return e.runBin(ctx, e.gcs, env, args...)
}

// runBin runs bin (e.gcs, or HooksBinary for env that asks for a test
// hook) as gcsRunStderr does.
func (e *fastEnv) runBin(ctx context.Context, bin string, env []string, args ...string) ([]byte, string, error) {
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(e.env(), env...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, stderr.String(), fmt.Errorf("gpucr-stream %v: %v: %s", args, err, stderr.String())
	}
	return out, stderr.String(), nil
}

type phases struct {
	Phases []phase `json:"phases"`
	PID    int     `json:"pid"`
}

type phase struct {
	Name string  `json:"name"`
	Secs float64 `json:"seconds"`
}

func (p phases) has(name string) bool {
	return slices.ContainsFunc(p.Phases, func(ph phase) bool { return ph.Name == name })
}

func (p phases) hasPrefix(name string) bool {
	return slices.ContainsFunc(p.Phases, func(ph phase) bool { return strings.HasPrefix(ph.Name, name) })
}

func TestFastPathCheckpointRestore(t *testing.T) {
	for _, keyed := range []bool{false, true} {
		t.Run(map[bool]string{false: "plain", true: "encrypted"}[keyed], func(t *testing.T) { fastCheckpointRestore(t, keyed) })
	}
}

// fastCheckpointRestore checkpoints and restores a fast-path process; keyed,
// with --key-file: the device memory the fast path moves is sealed like the
// rest, and the restore needs the key. The plain one keeps its copy where
// gpucr-stream does by default: a tmpfs of its own (as root), unmounted
// after the commit.
func fastCheckpointRestore(t *testing.T, keyed bool) {
	e := setupFast(t)
	ctx := testCtx(t)
	var keyArgs []string
	if keyed {
		key, err := e.gcsRun(ctx, "keygen")
		if err != nil {
			t.Fatal(err)
		}
		kf := filepath.Join(e.dir, "key")
		if err := os.WriteFile(kf, key, 0o600); err != nil {
			t.Fatal(err)
		}
		keyArgs = []string{"--key-file", kf}
	}
	pid, tdir, waitGone := e.start(t, "t")
	if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
		t.Fatalf("before: %q", r)
	}
	ar := filepath.Join(e.dir, "ar")
	args := []string{"checkpoint", "--pid", strconv.Itoa(pid), "--to", ar, "--work-dir", filepath.Join(e.dir, "w"),
		"--criu", e.criu, "--json", "--no-progress", "--vram-files", "3"}
	if keyed {
		args = append(args, "--vram-keep-dir", e.dir)
	}
	out, stderr, err := e.gcsRunStderr(ctx, nil, append(args, keyArgs...)...)
	if err != nil {
		t.Fatal(err)
	}
	if !keyed && strings.Contains(stderr, "not a tmpfs") {
		t.Fatalf("the kept copy did not get a tmpfs of its own: %s", stderr)
	}
	if mi, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(mi), "gpucr-vram-keep-") {
		t.Fatalf("a kept copy's mount left after the commit:\n%s", mi)
	}
	if ents, _ := filepath.Glob(filepath.Join(e.sockDir, "gpucr-vram-keep-*")); len(ents) != 0 {
		t.Fatalf("kept copy's directory left after the commit: %v", ents)
	}
	var ck phases
	if err := json.Unmarshal(out, &ck); err != nil || !ck.has("vram copy out") || !ck.has("vram store (beside the dump)") || !ck.has("gpu checkpoint") {
		t.Fatalf("checkpoint took no fast path: %s (%v)", out, err)
	}
	waitGone()
	m := archiveManifest(t, ar)
	if (m.Encryption != nil) != keyed {
		t.Fatalf("manifest encryption %+v, want it %v", m.Encryption, keyed)
	}
	if len(m.CUDA) != 1 || m.CUDA[0].PID != pid || m.CUDA[0].Path != manifest.CUDAPathPreload || len(m.CUDA[0].Files) != 3 || m.CUDA[0].Bytes == 0 {
		t.Fatalf("manifest cuda: %+v", m.CUDA)
	}
	for _, f := range m.CUDA[0].Files {
		if mf, ok := m.Lookup(f); !ok || !mf.External {
			t.Fatalf("%s: not in the checkpoint as an external file", f)
		}
	}
	if ents, _ := filepath.Glob(filepath.Join(e.dir, "gpucr-vram-keep-*", "*")); len(ents) != 0 {
		t.Fatalf("kept copy left after the commit: %v", ents)
	}
	mustInspectVRAM(ctx, t, e, ar, keyArgs, m.CUDA[0])
	// With the fill (gpuckpt/fill.go), which mustAdoptFill checks.
	restore := func(dir string, extra ...string) ([]byte, error) {
		return e.gcsRunEnv(ctx, []string{"GPUCR_FILL=1"}, append([]string{"restore", "--from", ar, "--work-dir", filepath.Join(e.dir, dir), "--criu", e.criu, "--json", "--no-progress"}, extra...)...)
	}
	if keyed {
		if _, err := restore("w1"); err == nil || !strings.Contains(err.Error(), m.Encryption.KeyID.String()) {
			t.Fatalf("restore without the key: %v", err)
		}
	}
	out, err = restore("w2", keyArgs...)
	mustRestoreFast(t, out, err, pid, tdir)
	// Its VRAM files were read into memory while CRIU restored, and
	// filled into the device by a filler, which the process adopted.
	var rs phases
	if json.Unmarshal(out, &rs) != nil || !rs.hasPrefix("vram staged ahead (3 of 3 files") {
		t.Fatalf("restore staged no VRAM files: %s", out)
	}
	mustAdoptFill(t, rs)
}

// mustAdoptFill checks that a restore's process adopted what its filler
// filled (gpuckpt/fill.go), and that no filler failed.
func mustAdoptFill(t *testing.T, rs phases) {
	t.Helper()
	if !rs.has("vram fill adopted by 1 process(es)") || rs.hasPrefix("vram fill of") || rs.hasPrefix("vram adopt of") {
		t.Fatalf("the restore did not adopt its fill: %+v", rs.Phases)
	}
}

// TestFastPathLauncherTree: torchrun's layout, where the root holds no
// GPU and starts the ranks (here a shell and two targets): the checkpoint
// moves both children's device memory and none of the root's, the restore
// brings the tree back, and each child reads its memory back intact.
func TestFastPathLauncherTree(t *testing.T) {
	e := setupFast(t)
	ctx := testCtx(t)
	// The ranks are orphaned when CRIU kills the shell: as their
	// subreaper, the test reaps them before the restore needs their PIDs
	// (a CI container's init may never do it).
	becomeSubreaper(t)
	root := filepath.Join(e.dir, "launcher")
	ranks := []string{filepath.Join(root, "r0"), filepath.Join(root, "r1")}
	for _, d := range ranks {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	script := fmt.Sprintf("%s %s & %s %s & while [ ! -e %s/ready ] || [ ! -e %s/ready ]; do sleep 0.01; done; touch %s/ready; wait",
		e.target, ranks[0], e.target, ranks[1], ranks[0], ranks[1], root)
	pid, wait := e.startCmd(t, root, "/bin/sh", "-c", script)
	for _, d := range ranks {
		if r := fastCheck(t, d, 5*time.Second); !strings.HasPrefix(r, "ok ") {
			t.Fatalf("%s before: %q", d, r)
		}
	}
	ar := filepath.Join(e.dir, "ar-launcher")
	out, err := e.gcsRun(ctx, "checkpoint", "--pid", strconv.Itoa(pid), "--to", ar, "--work-dir", filepath.Join(e.dir, "wl"),
		"--criu", e.criu, "--json", "--no-progress", "--vram-files", "2")
	if err != nil {
		t.Fatal(err)
	}
	// What checkpoint and restore print: their phases and CUDA processes.
	type treeResult struct {
		phases
		CUDAPIDs []int `json:"cuda_pids"`
	}
	var ck treeResult
	if err := json.Unmarshal(out, &ck); err != nil || !ck.has("vram copy out") || len(ck.CUDAPIDs) != 2 || slices.Contains(ck.CUDAPIDs, pid) {
		t.Fatalf("checkpoint of the launcher's tree: %s (%v)", out, err)
	}
	wait()
	for _, p := range ck.CUDAPIDs {
		if err := WaitPIDGone(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	out, err = e.gcsRun(ctx, "restore", "--from", ar, "--work-dir", filepath.Join(e.dir, "wl2"), "--criu", e.criu, "--json", "--no-progress")
	if err != nil {
		t.Fatal(err)
	}
	var rs treeResult
	if err := json.Unmarshal(out, &rs); err != nil || !rs.has("vram copy in") || rs.PID != pid || len(rs.CUDAPIDs) != 2 {
		t.Fatalf("restore of the launcher's tree: %s (%v)", out, err)
	}
	t.Cleanup(func() { syscall.Kill(-pid, syscall.SIGKILL) })
	for _, d := range ranks {
		if r := fastCheck(t, d, 5*time.Second); !strings.HasPrefix(r, "ok ") {
			t.Fatalf("%s after restore: %q", d, r)
		}
	}
}

// A dump that fails after the release (CRIU refuses its options), or the
// store of the VRAM files into the checkpoint (beside the driver's
// checkpoint and CRIU): the driver's state is undone, the memory mapped
// back and refilled from the kept copy, and the program runs on;
// --leave-running refills the same way.
func TestFastPathUndo(t *testing.T) {
	e := setupFast(t)
	ctx := testCtx(t)
	for _, tc := range []struct {
		name  string
		args  []string
		env   []string
		fails string // what the error says ("": it succeeds)
	}{
		{"criu fails", []string{"--criu-opts", "--no-such-criu-option"}, nil, "restored and unlocked"},
		{"store fails", nil, []string{"GPUCR_TEST_FAULT=store"}, "injected store failure"},
		{"leave running", []string{"--leave-running"}, nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pid, tdir, _ := e.start(t, strings.ReplaceAll(tc.name, " ", "-"))
			args := append([]string{"checkpoint", "--pid", strconv.Itoa(pid), "--to", filepath.Join(e.dir, "ar-"+tc.name),
				"--work-dir", filepath.Join(e.dir, "w-"+tc.name), "--criu", e.criu, "--json", "--no-progress", "--vram-keep-dir", e.dir}, tc.args...)
			bin := e.gcs
			if tc.env != nil {
				bin = HooksBinary(t) // GPUCR_TEST_FAULT
			}
			out, _, err := e.runBin(ctx, bin, tc.env, args...)
			if (err != nil) != (tc.fails != "") {
				t.Fatalf("checkpoint: %v %s", err, out)
			}
			if err != nil && (!strings.Contains(err.Error(), "restored and unlocked") || !strings.Contains(err.Error(), tc.fails)) {
				t.Fatalf("the error does not say what failed (%q) and that the GPU state was put back: %v", tc.fails, err)
			}
			if err != nil {
				t.Logf("checkpoint failed as it should: %v", err)
			}
			if tc.fails == "" {
				var ck phases
				if json.Unmarshal(out, &ck) != nil || !ck.has("vram refill") {
					t.Fatalf("no refill phase: %s", out)
				}
			}
			if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
				t.Fatalf("after the checkpoint: %q", r)
			}
			if ents, _ := filepath.Glob(filepath.Join(e.dir, "gpucr-vram-keep-*", "*")); len(ents) != 0 {
				t.Fatalf("kept copy left: %v", ents)
			}
		})
	}
}

// gpu suspend --to / gpu resume --from: the process stays alive, parked,
// with its device memory released and in a checkpoint, then gets it back.
func TestFastPathGPUSuspendResume(t *testing.T) {
	e := setupFast(t)
	ctx := testCtx(t)
	pid, tdir, _ := e.start(t, "s")
	// The store fails after the release: the memory comes back from the
	// kept copy, and the process runs on.
	out, _, err := e.runBin(ctx, HooksBinary(t), []string{"GPUCR_TEST_FAULT=store"}, "gpu", "suspend", "--pid", strconv.Itoa(pid), "--to", filepath.Join(e.dir, "ar-f"), "--json", "--vram-keep-dir", e.dir)
	if err == nil || !strings.Contains(err.Error(), "injected store failure") || !strings.Contains(err.Error(), "restored and unlocked") {
		t.Fatalf("suspend with a failing store: %v %s", err, out)
	}
	if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
		t.Fatalf("after a failed suspend: %q", r)
	}
	if ents, _ := filepath.Glob(filepath.Join(e.dir, "gpucr-vram-keep-*", "*")); len(ents) != 0 {
		t.Fatalf("kept copy left: %v", ents)
	}
	ar := filepath.Join(e.dir, "ar-s")
	out, err = e.gcsRun(ctx, "gpu", "suspend", "--pid", strconv.Itoa(pid), "--to", ar, "--json", "--vram-keep-dir", e.dir)
	if err != nil {
		t.Fatal(err)
	}
	var ph phases
	if json.Unmarshal(out, &ph) != nil || !ph.has("vram copy out") || !ph.has("vram store (beside the dump)") || !ph.has("commit") || !ph.has("gpu checkpoint") {
		t.Fatalf("suspend: %s", out)
	}
	// The device is free before the checkpoint is committed; the command
	// returns after the commit.
	var times struct {
		Released float64 `json:"memory_released_seconds"`
		Freed    float64 `json:"device_freed_seconds"`
		Total    float64 `json:"seconds"`
	}
	if json.Unmarshal(out, &times) != nil || times.Released <= 0 || times.Freed < times.Released || times.Total < times.Freed {
		t.Fatalf("suspend timings: %s", out)
	}
	if r := fastCheck(t, tdir, 300*time.Millisecond); r != "" {
		t.Fatalf("a suspended process answered: %q", r)
	}
	if !fileExists(filepath.Join(ar, manifest.ManifestName)) {
		t.Fatal("no committed checkpoint")
	}
	out, err = e.gcsRunEnv(ctx, []string{"GPUCR_FILL=1"}, "gpu", "resume", "--pid", strconv.Itoa(pid), "--from", ar, "--json")
	if err != nil {
		t.Fatal(err)
	}
	if json.Unmarshal(out, &ph) != nil || !ph.has("vram copy in") {
		t.Fatalf("resume: %s", out)
	}
	mustAdoptFill(t, ph)
	if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
		t.Fatalf("after resume: %q", r)
	}
}

// gpucr-stream killed (SIGKILL) between the release and the commit, at each
// step (GPUCR_TEST_PAUSE stops it there, and holds the store of the VRAM
// files from the kept copy: it is in flight at every step): before the
// driver's lock the
// library maps the memory back, refills it from the kept copy and lets the
// program run by itself; after it the program stays paused, locked by the
// driver, until `gpu resume --pid` restores the driver's state and has the
// library refill. A damaged kept copy leaves the program paused, and it
// says so. `gpu suspend --to` follows the same protocol.
func TestFastPathKilled(t *testing.T) {
	e := setupFast(t)
	ctx := testCtx(t)
	for _, tc := range []struct {
		name, step string
		damage     bool
		state      string // the library's status file ("": none)
		runs       bool   // the program runs on without gpu resume
		suspend    bool   // gpu suspend --to, not checkpoint
	}{
		{"before the driver", "released", false, "resumed", true, false},
		{"after the driver's checkpoint", "checkpointed", false, "waiting", false, false},
		{"before CRIU", "detached", false, "", false, false},
		{"during CRIU's dump", "post-dump", false, "", false, false},
		{"damaged kept copy", "released", true, "NOT RESUMED", false, false},
		{"gpu suspend before the driver", "released", false, "resumed", true, true},
		{"gpu suspend after the driver's checkpoint", "checkpointed", false, "waiting", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := strings.ReplaceAll(tc.name, " ", "-")
			name = strings.ReplaceAll(name, "'", "")
			pid, tdir, _ := e.start(t, "k-"+name)
			keepDir := filepath.Join(e.dir, "keep-"+name)
			if err := os.MkdirAll(keepDir, 0o700); err != nil {
				t.Fatal(err)
			}
			args := []string{"checkpoint", "--pid", strconv.Itoa(pid), "--to", filepath.Join(e.dir, "ar-"+name),
				"--work-dir", filepath.Join(e.dir, "w-"+name), "--criu", e.criu, "--no-progress", "--vram-files", "3", "--vram-keep-dir", keepDir}
			if tc.suspend {
				args = []string{"gpu", "suspend", "--pid", strconv.Itoa(pid), "--to", filepath.Join(e.dir, "ar-"+name),
					"--no-progress", "--vram-files", "3", "--vram-keep-dir", keepDir}
			}
			kill := e.runPaused(ctx, t, tc.step, args...)
			kept, _ := filepath.Glob(filepath.Join(keepDir, "gpucr-vram-keep-*", "vram-*.bin"))
			if len(kept) != 3 {
				t.Fatalf("kept copy: %v", kept)
			}
			if tc.damage {
				for _, k := range kept {
					if err := os.Truncate(k, 30); err != nil {
						t.Fatal(err)
					}
				}
			}
			kill()
			// Killed before its commit: no checkpoint is there (CRIU's
			// post-dump action failed with it, so CRIU resumed the
			// process instead of killing it).
			if fileExists(filepath.Join(e.dir, "ar-"+name, "manifest.json")) {
				t.Fatalf("a manifest was committed by a checkpoint killed at %s", tc.step)
			}
			status := filepath.Join(e.sockDir, "preload-"+strconv.Itoa(pid)+".status")
			var said []byte
			for end := time.Now().Add(5 * time.Second); tc.state != "" && time.Now().Before(end) && len(said) == 0; time.Sleep(10 * time.Millisecond) {
				said, _ = os.ReadFile(status)
			}
			if !strings.HasPrefix(string(said), tc.state) || (tc.state == "") != (len(said) == 0) {
				t.Fatalf("status file %q, want %q", said, tc.state)
			}
			if tc.state != "" {
				out, _ := os.ReadFile(filepath.Join(tdir, "out"))
				if !strings.Contains(string(out), "gpucr-preload["+strconv.Itoa(pid)+"]: "+tc.state+":") {
					t.Fatalf("the target said nothing on stderr: %q", out)
				}
			}
			if tc.runs {
				if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
					t.Fatalf("after gpucr-stream was killed: %q (%s)", r, said)
				}
				if left, _ := filepath.Glob(filepath.Join(keepDir, "*", "*")); len(left) != 0 {
					t.Fatalf("kept copy left after the refill: %v", left)
				}
				return
			}
			if r := fastCheck(t, tdir, 300*time.Millisecond); r != "" {
				t.Fatalf("the program ran: %q (%s)", r, said)
			}
			out, err := e.gcsRun(ctx, "gpu", "resume", "--pid", strconv.Itoa(pid), "--json")
			if tc.damage {
				if err == nil || !strings.Contains(err.Error(), "it stays parked") {
					t.Fatalf("gpu resume with a damaged kept copy: %v %s", err, out)
				}
				if r := fastCheck(t, tdir, 300*time.Millisecond); r != "" {
					t.Fatalf("the program ran on a damaged copy: %q", r)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var ph phases
			if json.Unmarshal(out, &ph) != nil || !ph.has("gpu restore") || !ph.has("gpu unlock") || !ph.has("vram refill") {
				t.Fatalf("gpu resume: %s", out)
			}
			if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
				t.Fatalf("after gpu resume: %q", r)
			}
			if left, _ := filepath.Glob(filepath.Join(keepDir, "*", "*")); len(left) != 0 {
				t.Fatalf("kept copy left after the refill: %v", left)
			}
		})
	}
}

// A fast-path checkpoint into a stream (--to -): the VRAM files travel in
// it, and `restore --from` the stream finds them by name (a stream carries
// no manifest a restore reads) and copies them in.
func TestFastPathStream(t *testing.T) {
	e := setupFast(t)
	ctx := testCtx(t)
	pid, tdir, waitGone := e.start(t, "st")
	stream := filepath.Join(e.dir, "ck.stream")
	f, err := os.Create(stream)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, e.gcs, "checkpoint", "--pid", strconv.Itoa(pid), "--to", "-", "--work-dir", filepath.Join(e.dir, "w"),
		"--criu", e.criu, "--no-progress", "--vram-files", "2", "--vram-keep-dir", e.dir)
	cmd.Env = e.env()
	cmd.Stdout = f
	var stderr strings.Builder
	cmd.Stderr = &stderr
	err = cmd.Run()
	f.Close()
	if err != nil {
		t.Fatalf("checkpoint --to -: %v: %s", err, stderr.String())
	}
	if !strings.Contains(stderr.String(), "vram copy out") {
		t.Fatalf("checkpoint --to - took no fast path: %s", stderr.String())
	}
	waitGone()
	out, err := e.gcsRun(ctx, "inspect", stream)
	if err != nil || !strings.Contains(string(out), fmt.Sprintf("vram-%d-01.bin", pid)) {
		t.Fatalf("the stream holds no VRAM files: %v %s", err, out)
	}
	out, err = e.gcsRun(ctx, "restore", "--from", stream, "--work-dir", filepath.Join(e.dir, "w2"), "--criu", e.criu, "--json", "--no-progress")
	mustRestoreFast(t, out, err, pid, tdir)
}

// mustInspectVRAM checks what inspect reads of a checkpoint's VRAM files
// (issue 36): every file, allocated more than written (the target leaves
// most of its KV cache zero), and the data they hold is what the manifest
// records as moved.
func mustInspectVRAM(ctx context.Context, t *testing.T, e *fastEnv, ar string, keyArgs []string, p manifest.CUDAProcess) {
	t.Helper()
	out, err := e.gcsRun(ctx, append([]string{"inspect", "--json", ar}, keyArgs...)...)
	if err != nil {
		t.Fatal(err)
	}
	var res struct {
		VRAM []struct {
			Name                               string
			Allocated, Written, Cached, Stored int64
			Data                               int64
		} `json:"vram"`
		Note string `json:"vram_note"`
	}
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatal(err)
	}
	var alloc, written, data int64
	for _, v := range res.VRAM {
		alloc, written, data = alloc+v.Allocated, written+v.Written, data+v.Data
	}
	if len(res.VRAM) != len(p.Files) || written >= alloc || data != p.Bytes || data != written {
		t.Fatalf("inspect's VRAM files: %s, want %d files holding the %d bytes moved", out, len(p.Files), p.Bytes)
	}
}
