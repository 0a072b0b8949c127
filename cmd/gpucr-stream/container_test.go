package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/e2e"
	"github.com/gpucr/gpucr-stream/testwait"
)

// TestMain lets this test binary serve as gpucr-stream's swrk: runc,
// which the container tests drive, runs its criu (this program) as
// `PROGRAM swrk FD`.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == "swrk" {
		os.Exit(realMain())
	}
	os.Exit(m.Run())
}

// TestContainerGPUSteps: a container's checkpoint and restore take the
// GPU steps a process's take, around the runtime's CRIU: its CUDA
// processes (here a fake driver's, in a real runc container with real
// CRIU) are locked and checkpointed before runc dumps, and restored and
// unlocked after runc restores.
func TestContainerGPUSteps(t *testing.T) {
	criu := e2e.CRIU(t)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(3*time.Minute))
	defer cancel()
	dir := e2e.ShortTempDir(t)
	tg, root, id, pid := e2e.RuncContainer(ctx, t, dir, 32)
	before, err := tg.Prove(ctx)
	if err != nil {
		t.Fatal(err)
	}
	p := strconv.Itoa(tg.PID())
	f := withFakeCUDA(t, tg.PID())
	archive := filepath.Join(dir, "ckpt")
	if _, err := runGPUCmd(ctx, "checkpoint", "--container", id, "--runtime-root", root, "--to", archive, "--criu", criu); err != nil {
		t.Fatal(err)
	}
	if got, want := f.Log(), "lock "+p+", checkpoint "+p; got != want {
		t.Fatalf("driver calls after the checkpoint %q, want %q", got, want)
	}
	if err := e2e.WaitPIDGone(ctx, tg.PID()); err != nil {
		t.Fatal(err)
	}
	out, err := runGPUCmd(ctx, "restore", "--container", id, "--runtime-root", root, "--from", archive, "--criu", criu)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := f.Log(), "lock "+p+", checkpoint "+p+", restore "+p+", unlock "+p; got != want {
		t.Fatalf("driver calls after the restore %q, want %q", got, want)
	}
	if f.States[tg.PID()] != cudadriver.StateRunning {
		t.Fatalf("GPU state left %s", f.States[tg.PID()])
	}
	tg.Follow(t, pid)
	if strings.TrimSpace(out) != strconv.Itoa(tg.PID()) {
		t.Errorf("restore printed %q, the container's init is %d", out, tg.PID())
	}
	tg.ProveIntact(ctx, t, &before)
}

// TestInstalledAsCriu: gpucr-stream installed as criu ahead of the real
// one on PATH (for runtimes that run criu from PATH) hands every command
// line but swrk to the real criu.
func TestInstalledAsCriu(t *testing.T) {
	criu := e2e.CRIU(t)
	dir := t.TempDir()
	if err := os.Symlink(e2e.BuildBinary(t, "./cmd/gpucr-stream"), filepath.Join(dir, "criu")); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(dir, "criu"), "--version")
	cmd.Env = append(os.Environ(), "PATH="+dir+string(os.PathListSeparator)+filepath.Dir(criu)+string(os.PathListSeparator)+os.Getenv("PATH"))
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Version: 4.") {
		t.Fatalf("criu --version through gpucr-stream: %v: %s", err, out)
	}
}
