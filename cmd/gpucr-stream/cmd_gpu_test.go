package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/cudadriver/drivertest"
	"github.com/gpucr/gpucr-stream/e2e"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/testwait"
)

// withFakeCUDA makes the commands see the target as a CUDA process driven
// by a fake driver.
func withFakeCUDA(t *testing.T, pid int) *drivertest.Fake {
	f := drivertest.NewFake(pid)
	oldOpen, oldFind := openDriver, findCUDAProcs
	openDriver = func() (cudadriver.Driver, error) { return f, nil }
	findCUDAProcs = drivertest.Find(pid)
	t.Cleanup(func() { openDriver, findCUDAProcs = oldOpen, oldFind })
	return f
}

func runGPUCmd(ctx context.Context, args ...string) (string, error) {
	var out, errOut bytes.Buffer
	err := run(ctx, args, strings.NewReader(""), &out, &errOut)
	if err != nil {
		return out.String(), fmt.Errorf("%w; stderr: %s", err, errOut.String())
	}
	return out.String(), nil
}

// TestCheckpointUndoesGPUStep runs the checkpoint command against a real
// process with real CRIU and a fake CUDA driver: when the dump fails in its
// middle (the destination fills up while CRIU holds the process frozen) or
// CRIU fails at its start, the GPU state is restored and unlocked, in that
// order, and the process runs on intact; when the lock or the GPU
// checkpoint fails, CRIU never runs.
func TestCheckpointUndoesGPUStep(t *testing.T) {
	criu := e2e.CRIU(t)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(3*time.Minute))
	defer cancel()
	dir := e2e.ShortTempDir(t)
	tg := e2e.StartTarget(t, filepath.Join(dir, "target"), 32)
	before, err := tg.Prove(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pid := strconv.Itoa(tg.PID())
	// A destination too small for the dump: the capture fails while CRIU
	// streams the pages.
	full := filepath.Join(dir, "full")
	os.MkdirAll(full, 0o755)
	fullOK := syscall.Mount("tmpfs", full, "tmpfs", 0, "size=4m") == nil
	if fullOK {
		t.Cleanup(func() { syscall.Unmount(full, syscall.MNT_DETACH) })
	}
	cases := []struct {
		name, failOn, criuOpts, want string
	}{
		{"dump-fails-midway", "", "", "lock P, checkpoint P, restore P, unlock P"},
		{"criu-fails-at-start", "", "--action-script /bin/false", "lock P, checkpoint P, restore P, unlock P"},
		{"lock-fails", "lock", "", "lock P"},
		{"checkpoint-fails", "checkpoint", "", "lock P, checkpoint P, unlock P"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := withFakeCUDA(t, tg.PID())
			if c.failOn != "" {
				f.FailOn[c.failOn] = true
			}
			archive := filepath.Join(dir, "ar-"+c.name)
			args := []string{"checkpoint", "--pid", pid, "--to", archive, "--criu", criu, "--work-dir", e2e.ShortTempDir(t)}
			if c.name == "dump-fails-midway" {
				if !fullOK {
					t.Skip("cannot mount a small tmpfs")
				}
				archive = filepath.Join(full, "ar")
				args = append(args, "--to", archive, "--codec", "none", "--segment-size", "1MiB")
			}
			if c.criuOpts != "" {
				args = append(args, "--criu-opts", c.criuOpts)
			}
			_, err := runGPUCmd(ctx, args...)
			if err == nil {
				t.Fatal("checkpoint succeeded")
			}
			t.Logf("checkpoint failed as it should: %v", err)
			if got, want := f.Log(), strings.ReplaceAll(c.want, "P", pid); got != want {
				t.Fatalf("driver calls %q, want %q", got, want)
			}
			if f.States[tg.PID()] != cudadriver.StateRunning {
				t.Fatalf("GPU state left %s", f.States[tg.PID()])
			}
			if _, err := os.Stat(filepath.Join(archive, manifest.ManifestName)); err == nil {
				t.Fatal("a failed checkpoint left a manifest")
			}
			tg.ProveIntact(ctx, t, &before)
		})
	}

	// The undo fails too (the driver refuses the restore, as driver 580
	// did for NCCL ranks): the error and --json say where the process is
	// left and the command that brings it back.
	t.Run("undo-fails", func(t *testing.T) {
		f := withFakeCUDA(t, tg.PID())
		f.FailOn["restore"] = true
		out, err := runGPUCmd(ctx, "checkpoint", "--pid", pid, "--to", filepath.Join(dir, "ar-undo"), "--criu", criu,
			"--work-dir", e2e.ShortTempDir(t), "--criu-opts", "--action-script /bin/false", "--json")
		if err == nil {
			t.Fatal("checkpoint succeeded")
		}
		var got struct {
			Error string `json:"error"`
			Procs []struct {
				PID            int
				State, Recover string
			} `json:"gpu_processes"`
		}
		if jerr := json.Unmarshal([]byte(out), &got); jerr != nil || len(got.Procs) != 1 || got.Procs[0].PID != tg.PID() ||
			got.Procs[0].State != "checkpointed" || !strings.Contains(got.Procs[0].Recover, "gpucr-stream gpu restore --pid "+pid) {
			t.Fatalf("--json: %q (%v)", out, jerr)
		}
		if !strings.Contains(err.Error(), "Left so: process "+pid+" is checkpointed: `gpucr-stream gpu restore --pid "+pid+"`") {
			t.Errorf("the error does not say where the process is: %v", err)
		}
	})

	// --leave-running: checkpoint, then restore + unlock; the process runs
	// on. The manifest records the CUDA process.
	t.Run("leave-running", func(t *testing.T) {
		f := withFakeCUDA(t, tg.PID())
		archive := filepath.Join(dir, "ar-leave")
		out, err := runGPUCmd(ctx, "checkpoint", "--pid", pid, "--to", archive, "--criu", criu, "--leave-running", "--json")
		if err != nil {
			t.Fatal(err)
		}
		if got, want := f.Log(), strings.ReplaceAll("lock P, checkpoint P, restore P, unlock P", "P", pid); got != want {
			t.Fatalf("driver calls %q, want %q", got, want)
		}
		var res checkpointResult
		if err := json.Unmarshal([]byte(out), &res); err != nil {
			t.Fatal(err)
		}
		names := map[string]bool{}
		for _, p := range res.Phases {
			names[p.Name] = true
		}
		for _, n := range []string{"gpu checkpoint", "criu dump + encode + write", "commit", "gpu restore"} {
			if !names[n] {
				t.Errorf("no %q phase in %s", n, out)
			}
		}
		if len(res.CUDAPIDs) != 1 || len(res.GPUs) == 0 || res.GPUs[0].PID != tg.PID() {
			t.Errorf("result names no CUDA process: %s", out)
		}
		tg.ProveIntact(ctx, t, &before)
	})

	// A checkpoint that kills the process, then restore: CRIU restore, then
	// CUDA restore and unlock of the restored process.
	t.Run("restore", func(t *testing.T) {
		f := withFakeCUDA(t, tg.PID())
		archive := filepath.Join(dir, "ar-kill")
		if _, err := runGPUCmd(ctx, "checkpoint", "--pid", pid, "--to", archive, "--criu", criu); err != nil {
			t.Fatal(err)
		}
		if err := tg.WaitGone(ctx); err != nil {
			t.Fatal(err)
		}
		out, err := runGPUCmd(ctx, "restore", "--from", archive, "--criu", criu, "--json")
		if err != nil {
			t.Fatal(err)
		}
		if got, want := f.Log(), strings.ReplaceAll("lock P, checkpoint P, restore P, unlock P", "P", pid); got != want {
			t.Fatalf("driver calls %q, want %q", got, want)
		}
		var res restoreResult
		if err := json.Unmarshal([]byte(out), &res); err != nil || res.PID != tg.PID() || len(res.CUDAPIDs) != 1 {
			t.Fatalf("restore result %s: %v", out, err)
		}
		tg.ProveIntact(ctx, t, &before)
	})
}

func TestGPUMapFor(t *testing.T) {
	// --gpu-map as restore and receive read it: parsed, then resolved
	// against the checkpoint's GPUs.
	gpuMapFor := func(spec string, gpus []manifest.GPU) ([]cudadriver.GPUPair, error) {
		m, err := parseGPUMap(spec)
		if err != nil {
			return nil, err
		}
		return m.For(gpus)
	}
	const u = "GPU-b9866d0b-7eb7-389c-2420-04c59d30be30"
	pairs, err := gpuMapFor("all="+u, []manifest.GPU{{UUID: "GPU-00000000-0000-0000-0000-000000000001", PID: 1}})
	if err != nil || len(pairs) != 1 || pairs[0].Old[15] != 1 || pairs[0].New.String() != u {
		t.Fatalf("all=: %v %v", pairs, err)
	}
	if _, err := gpuMapFor("all="+u, nil); err == nil {
		t.Fatal("all= without a recorded GPU accepted")
	}
	if _, err := gpuMapFor("nonsense", nil); err == nil {
		t.Fatal("bad map accepted")
	}
}

func TestNoDriverMessages(t *testing.T) {
	old := openDriver
	openDriver = func() (cudadriver.Driver, error) { return cudadriver.OpenLibrary("/nonexistent/libcuda.so.1") }
	defer func() { openDriver = old }()
	_, err := runGPUCmd(context.Background(), "gpu", "info")
	if err == nil || !strings.Contains(err.Error(), "no CUDA driver") {
		t.Fatalf("gpu info without a driver: %v", err)
	}
	if code := exitCode(err, false); code != exitFailure {
		t.Fatalf("exit code %d", code)
	}
	_, err = runGPUCmd(context.Background(), "checkpoint", "--pid", strconv.Itoa(os.Getpid()), "--cuda", "on", "--to", filepath.Join(t.TempDir(), "a"))
	if err == nil || !strings.Contains(err.Error(), "no CUDA driver") {
		t.Fatalf("checkpoint --cuda on without a driver: %v", err)
	}
}

// TestGPUFastPathWiring: gpu hands --to and --from to the library, which
// refuses them on the wrong action and refuses suspend --to for a process
// without the fast-path library, before any driver step.
func TestGPUFastPathWiring(t *testing.T) {
	t.Setenv("GPUCR_PRELOAD_DIR", t.TempDir())
	pid := os.Getpid()
	f := withFakeCUDA(t, pid)
	ar := filepath.Join(t.TempDir(), "ar")
	p := strconv.Itoa(pid)
	for _, tc := range []struct {
		args    []string
		code    int
		errText string
	}{
		{[]string{"gpu", "lock", "--pid", p, "--to", ar}, exitUsage, "does not take --to"},
		{[]string{"gpu", "suspend", "--pid", p, "--from", ar}, exitUsage, "does not take --from"},
		{[]string{"gpu", "suspend", "--pid", p, "--to", ar, "--fast-path", "off"}, exitUsage, "needs the fast path"},
		{[]string{"gpu", "suspend", "--pid", p, "--to", ar, "--vram-files", "65"}, exitUsage, "--vram-files"},
		{[]string{"gpu", "suspend", "--pid", p, "--to", ar}, exitFailure, "library is not loaded"},
	} {
		_, err := runGPUCmd(context.Background(), tc.args...)
		if code := exitCode(err, false); code != tc.code || err == nil || !strings.Contains(err.Error(), tc.errText) {
			t.Errorf("%v: exit %d, %v; want exit %d, %q", tc.args, code, err, tc.code, tc.errText)
		}
	}
	if log := f.Log(); log != "" {
		t.Errorf("driver steps %q", log)
	}
	if _, err := os.Stat(ar); err == nil {
		t.Errorf("a refused gpu suspend --to left %s", ar)
	}
}
