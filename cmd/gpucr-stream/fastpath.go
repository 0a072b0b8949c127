package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/sinks"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/vram"
)

// The GPU fast path in the commands (vram/fastpath.go has the mechanism):
// `run` starts a program with libgpucr-preload; checkpoint moves the
// device memory of such processes into the capture before the driver's
// checkpoint; restore puts it back after the driver's restore.

// preloadPath finds the library: next to the binary, else the install dir.
func preloadPath() (string, error) {
	var tried []string
	if exe, err := os.Executable(); err == nil {
		if exe, err = filepath.EvalSymlinks(exe); err == nil {
			tried = append(tried, filepath.Join(filepath.Dir(exe), vram.PreloadLibrary))
		}
	}
	tried = append(tried, filepath.Join("/usr/local/lib/gpucr-stream", vram.PreloadLibrary))
	for _, p := range tried {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found (looked at %s; make build puts it next to the binary)", vram.PreloadLibrary, strings.Join(tried, ", "))
}

// runRun execs the program with the library preloaded.
func runRun(cfg *config, args []string) error {
	if len(args) > 0 && args[0] == "--" {
		args = args[1:]
	}
	if len(args) == 0 {
		return usagef("run needs a program: gpucr-stream run -- CMD [ARGS...]")
	}
	lib, err := preloadPath()
	if err != nil {
		return err
	}
	prog := args[0]
	if !strings.Contains(prog, "/") {
		if prog, err = lookPath(prog); err != nil {
			return err
		}
	}
	env := os.Environ()
	pre := lib
	for i, e := range env {
		if old, ok := strings.CutPrefix(e, "LD_PRELOAD="); ok {
			if old != "" {
				pre = lib + ":" + old
			}
			env = append(env[:i], env[i+1:]...)
			break
		}
	}
	env = append(env, "LD_PRELOAD="+pre)
	if err := syscall.Exec(prog, args, env); err != nil {
		return fmt.Errorf("run %s: %w", prog, err)
	}
	return nil
}

func lookPath(name string) (string, error) {
	for _, dir := range filepath.SplitList(os.Getenv("PATH")) {
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("run: %s: not found on PATH", name)
}

// fastSuspend moves the device memory of cc's processes into c when every
// one of them runs with the library and can (--fast-path auto); else it
// does nothing and the driver's checkpoint takes it all, as without the
// library. It records the path each process took in meta.
func (cc *cudaCheckpoint) fastSuspend(ctx context.Context, cfg *config, c *streamer.Capture, meta *manifest.Manifest) ([]phase, error) {
	if cc == nil {
		return nil, nil
	}
	record := func() {
		meta.CUDA = nil
		byPID := map[int]vram.FastProc{}
		for _, p := range cc.fast.Procs() {
			byPID[p.PID] = p
		}
		for _, pid := range cc.pids {
			if p, ok := byPID[pid]; ok {
				meta.CUDA = append(meta.CUDA, manifest.CUDAProcess{PID: pid, Path: manifest.CUDAPathPreload, Files: p.Files, Bytes: p.Bytes})
			} else {
				meta.CUDA = append(meta.CUDA, manifest.CUDAProcess{PID: pid, Path: manifest.CUDAPathDriver})
			}
		}
	}
	record()
	switch cfg.fastPath {
	case "off":
		return nil, nil
	case "auto":
	default:
		return nil, usagef("--fast-path %q: want auto or off", cfg.fastPath)
	}
	if cfg.vramFiles < 1 || cfg.vramFiles > 64 {
		return nil, usagef("--vram-files %d: want 1..64", cfg.vramFiles)
	}
	// A restore brings the memory back from an archive's manifest; a stream
	// destination (stdout, a stream file) keeps the driver path.
	if loc, err := sinks.ParseLocation(cfg.to); err != nil || (loc.Kind != sinks.Archive && loc.Kind != sinks.S3) {
		return nil, nil
	}
	dir := vram.PreloadDir()
	for _, pid := range cc.pids {
		if !vram.HasPreload(pid) {
			return nil, nil
		}
	}
	if _, err := vram.FastCheck(ctx, dir, cc.pids); err != nil {
		fmt.Fprintf(cfg.stderr, "gpucr-stream: GPU fast path not taken: %v\n", err)
		return nil, nil
	}
	keep, err := os.MkdirTemp(cfg.vramKeepDir, "gpucr-vram-keep-")
	if err != nil {
		return nil, fmt.Errorf("fast path: %w", err)
	}
	cc.keepDir = keep
	put := func(ctx context.Context, name string, r io.Reader) error {
		_, err := c.WriteFile(name, r, true)
		return err
	}
	start := time.Now()
	cc.fast, err = vram.FastSuspend(ctx, cc.pids, put, vram.FastOptions{Dir: dir, Files: cfg.vramFiles, KeepDir: keep})
	t := cc.fast.Timings
	phases := []phase{{"vram park", t.Park.Seconds()}, {"vram copy out", t.CopyOut.Seconds()}, {"vram release", t.Release.Seconds()}}
	if err != nil {
		os.RemoveAll(keep)
		return phases, err
	}
	record()
	if d := time.Since(start).Seconds(); d > 0 {
		fmt.Fprintf(cfg.stderr, "gpucr-stream: GPU fast path: %s of device memory moved out in %.2fs (%.1f GB/s)\n",
			humanBytes(cc.fast.Bytes()), d, float64(cc.fast.Bytes())/d/1e9)
	}
	return phases, nil
}

// fastUndo refills what fastSuspend released (after the driver's state is
// back), for a failed dump or --leave-running.
func (cc *cudaCheckpoint) fastUndo(ctx context.Context) error {
	if cc == nil || cc.fast == nil {
		return nil
	}
	err := cc.fast.Undo(ctx)
	os.RemoveAll(cc.keepDir)
	return err
}

// fastCommit drops the kept copy once the checkpoint is committed.
func (cc *cudaCheckpoint) fastCommit() {
	if cc == nil || cc.fast == nil {
		return
	}
	cc.fast.Commit()
	os.RemoveAll(cc.keepDir)
}

// fastRestore brings back the device memory of the restored processes that
// took the fast path, after the driver's restore and unlock.
func fastRestore(ctx context.Context, src streamer.Source, procs []manifest.CUDAProcess) ([]phase, error) {
	var remap, copyIn time.Duration
	var n int64
	var errs []error
	for _, p := range procs {
		if p.Path != manifest.CUDAPathPreload {
			continue
		}
		get := func(ctx context.Context, name string, w io.Writer) error {
			_, err := src.Copy(ctx, name, w)
			return err
		}
		r, c, b, err := vram.FastResume(ctx, vram.PreloadDir(), p.PID, p.Files, get)
		remap, copyIn, n = remap+r, copyIn+c, n+b
		if err != nil {
			errs = append(errs, err)
		}
	}
	if remap == 0 && copyIn == 0 && len(errs) == 0 {
		return nil, nil
	}
	ps := []phase{{"vram remap", remap.Seconds()}, {"vram copy in", copyIn.Seconds()}}
	if err := errors.Join(errs...); err != nil {
		return ps, fmt.Errorf("%w; the process stays parked (its device memory is not back)", err)
	}
	return ps, nil
}

// gpuSuspendTo is `gpu suspend --pid P --to DEST` for processes that run
// with the library: their device memory goes into a checkpoint at DEST
// (committed), is released, and the driver's lock and checkpoint free the
// rest (the context), so the process stays alive with no device memory.
// On failure everything is put back and the process runs on.
func gpuSuspendTo(ctx context.Context, cfg *config, drv vram.Driver, pids []int, lockTimeout time.Duration) ([]phase, error) {
	cc := &cudaCheckpoint{drv: drv, pids: pids}
	if cfg.fastPath == "off" {
		return nil, usagef("gpu suspend --to needs the fast path (--fast-path auto)")
	}
	if _, err := vram.FastCheck(ctx, vram.PreloadDir(), pids); err != nil {
		return nil, fmt.Errorf("gpu suspend --to: %w", err)
	}
	c, _, err := startCapture(ctx, cfg)
	if err != nil {
		return nil, err
	}
	meta := manifest.Manifest{Tool: "gpucr-stream " + version}
	phases, err := cc.fastSuspend(ctx, cfg, c, &meta)
	if err == nil && cc.fast == nil {
		err = fmt.Errorf("gpu suspend --to %s: the fast path was not taken (a stream destination?)", sinks.Redact(cfg.to))
	}
	if err != nil {
		c.Abort(err)
		_, _ = c.Close(ctx, manifest.Manifest{})
		return phases, err
	}
	t := time.Now()
	_, err = c.Close(ctx, meta)
	phases = append(phases, phase{"commit", time.Since(t).Seconds()})
	if err != nil {
		return phases, errGPUUndone(err, pids, cc.fastUndo(ctx))
	}
	ps, err := cc.suspend(lockTimeout)
	phases = append(phases, ps...)
	if err != nil {
		return phases, errGPUUndone(err, pids, cc.fastUndo(ctx))
	}
	cc.fastCommit()
	return phases, nil
}

// gpuResumeFrom is `gpu resume --pid P --from SRC`: the driver's restore
// and unlock, then the device memory of the processes that took the fast
// path comes back from SRC.
func gpuResumeFrom(ctx context.Context, cfg *config, drv vram.Driver, pids []int, pairs []vram.GPUPair) ([]phase, error) {
	src, err := openSource(ctx, cfg, cfg.from, streamer.StreamOptions{})
	if err != nil {
		return nil, err
	}
	defer src.Close()
	a, ok := src.(*streamer.ArchiveSource)
	if !ok {
		return nil, usagef("gpu resume --from: %s is not an archive", sinks.Redact(cfg.from))
	}
	_, t, err := vram.ResumeRestored(drv, pids, pairs)
	phases := timingPhases(t)
	if err != nil {
		return phases, err
	}
	ps, err := fastRestore(ctx, src, a.Manifest().CUDA)
	return append(phases, ps...), err
}
