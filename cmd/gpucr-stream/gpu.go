package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/vram"
)

// openDriver is the CUDA driver the commands use, and findCUDAProcs how
// they find CUDA processes; tests replace them with fakes.
var (
	openDriver    = vram.Open
	findCUDAProcs = vram.FindCUDA
)

// lockTimeout parses --lock-timeout.
func (c *config) lockTimeoutDur() (time.Duration, error) {
	d, err := time.ParseDuration(c.lockTimeout)
	if err != nil || d < 0 {
		return 0, usagef("--lock-timeout %q: want a duration such as 10s", c.lockTimeout)
	}
	return d, nil
}

func checkCUDAMode(mode string) error {
	switch mode {
	case "auto", "on", "off":
		return nil
	}
	return usagef("--cuda %q: want auto, on or off", mode)
}

// cudaCheckpoint is the GPU side of one checkpoint: the CUDA processes of
// the tree and their suspension.
type cudaCheckpoint struct {
	drv  vram.Driver
	pids []int
	gpus []vram.GPUInfo
	sus  *vram.Suspension
	// fast: the device memory the fast path moved out (nil: the driver
	// takes it all); keepDir holds its copy until the commit.
	fast    *vram.FastSuspension
	keepDir string
	// driverVersion is the CUDA version of the driver ("13.0").
	driverVersion string
}

// findCUDA decides, per --cuda, which processes of root's tree have GPU
// state to suspend. nil without any (or with --cuda off).
func findCUDA(cfg *config, root int) (*cudaCheckpoint, error) {
	if err := checkCUDAMode(cfg.cuda); err != nil {
		return nil, err
	}
	if cfg.cuda == "off" {
		return nil, nil
	}
	found, _, err := findCUDAProcs(root)
	if err != nil {
		return nil, err
	}
	if len(found) == 0 && cfg.cuda == "auto" {
		return nil, nil
	}
	drv, err := openDriver()
	if err != nil {
		if len(found) > 0 {
			return nil, fmt.Errorf("processes %v of the tree use CUDA, but the driver cannot be used: %w (--cuda off dumps without the GPU step, which CRIU refuses for a process holding the GPU)", vram.PIDs(found), err)
		}
		return nil, fmt.Errorf("--cuda on: %w", err)
	}
	cc := &cudaCheckpoint{drv: drv}
	if v, err := drv.Version(); err == nil {
		cc.driverVersion = vram.VersionString(v)
	}
	for _, u := range found {
		if u.DeviceFDs == 0 {
			// libcuda loaded but no GPU open: either never initialised
			// (nothing to do) or already checkpointed (Suspend leaves it).
			if _, err := drv.State(u.PID); err != nil {
				continue
			}
		}
		cc.pids = append(cc.pids, u.PID)
	}
	if len(cc.pids) == 0 {
		if cfg.cuda == "on" {
			return nil, fmt.Errorf("--cuda on: no CUDA process in the tree of %d", root)
		}
		return nil, nil
	}
	return cc, nil
}

// manifestGPUs turns what nvidia-smi said into manifest records.
func (cc *cudaCheckpoint) manifestGPUs() []manifest.GPU {
	if cc == nil {
		return nil
	}
	var out []manifest.GPU
	for _, g := range cc.gpus {
		d := g.Driver
		if cc.driverVersion != "" {
			if d != "" {
				d += " (CUDA " + cc.driverVersion + ")"
			} else {
				d = "CUDA " + cc.driverVersion
			}
		}
		out = append(out, manifest.GPU{UUID: g.UUID, Name: g.Name, Driver: d, PID: g.PID, Bytes: g.Bytes})
	}
	if len(out) == 0 {
		for _, pid := range cc.pids {
			out = append(out, manifest.GPU{Driver: "CUDA " + cc.driverVersion, PID: pid})
		}
	}
	return out
}

// queryGPUs records the GPUs of cc's processes in meta. A nil cc (no CUDA
// process) does nothing.
func (cc *cudaCheckpoint) queryGPUs(ctx context.Context, meta *manifest.Manifest) []phase {
	if cc == nil {
		return nil
	}
	// Ask nvidia-smi while the processes still hold the GPU.
	q := time.Now()
	cc.gpus, _ = vram.GPUs(ctx, cc.pids)
	meta.GPUs = cc.manifestGPUs()
	return []phase{{"gpu query (nvidia-smi)", time.Since(q).Seconds()}}
}

// suspend moves the GPU state of cc's processes into host memory (lock,
// then checkpoint), so that CRIU can dump them. On failure Suspend has
// undone its steps: the processes run on.
func (cc *cudaCheckpoint) suspend(lockTimeout time.Duration) ([]phase, error) {
	if cc == nil {
		return nil, nil
	}
	var err error
	cc.sus, err = vram.Suspend(cc.drv, cc.pids, lockTimeout)
	return timingPhases(cc.sus.Timings), err
}

// undo is for a dump that failed after suspend: CRIU resumed the process
// (or never stopped it), so its GPU state must come back too. It returns
// cause, saying whether that worked.
func (cc *cudaCheckpoint) undo(cause error) error {
	if cc == nil {
		return cause
	}
	// The driver's state first, then the memory the fast path released.
	return errGPUUndone(cause, cc.pids, errors.Join(cc.sus.Resume(nil), cc.fastUndo(context.Background())))
}

// resume puts the GPU state back after a committed dump that left the
// process running (--leave-running), and times the driver steps.
func (cc *cudaCheckpoint) resume() ([]phase, error) {
	if cc == nil {
		return nil, nil
	}
	before := cc.sus.Timings
	err := cc.sus.Resume(nil)
	t := cc.sus.Timings
	ps := timingPhases(vram.Timings{Restore: t.Restore - before.Restore, Unlock: t.Unlock - before.Unlock})
	if cc.fast != nil {
		start := time.Now()
		err = errors.Join(err, cc.fastUndo(context.Background()))
		ps = append(ps, phase{"vram refill", time.Since(start).Seconds()})
	}
	return ps, err
}

// cudaPIDs are the suspended CUDA processes (nil without any).
func (cc *cudaCheckpoint) cudaPIDs() []int {
	if cc == nil {
		return nil
	}
	return cc.pids
}

// cudaRestore finds the CUDA processes of a restored tree and brings them
// back onto the GPU. It returns the pids it resumed.
func cudaRestore(cfg *config, root int, pairs []vram.GPUPair) ([]int, vram.Timings, error) {
	var t vram.Timings
	if cfg.cuda == "off" {
		return nil, t, nil
	}
	found, _, err := findCUDAProcs(root)
	if err != nil {
		return nil, t, err
	}
	if len(found) == 0 {
		if cfg.cuda == "on" {
			return nil, t, fmt.Errorf("--cuda on: no CUDA process in the restored tree of %d", root)
		}
		return nil, t, nil
	}
	drv, err := openDriver()
	if err != nil {
		return nil, t, fmt.Errorf("restored processes %v use CUDA, but the driver cannot be used: %w; they stay suspended (checkpointed) until `gpucr-stream gpu resume --pid PID` succeeds", vram.PIDs(found), err)
	}
	var pids []int
	for _, u := range found {
		if _, err := drv.State(u.PID); err == nil {
			pids = append(pids, u.PID)
		} else if u.DeviceFDs > 0 {
			return nil, t, err
		}
	}
	resumed, t, err := vram.ResumeRestored(drv, pids, pairs)
	if err != nil {
		return resumed, t, fmt.Errorf("%w; the restored process stays suspended: retry with `gpucr-stream gpu resume --pid PID`", err)
	}
	if cfg.cuda == "on" && len(resumed) == 0 {
		return nil, t, fmt.Errorf("--cuda on: no restored process was checkpointed on the GPU")
	}
	return resumed, t, nil
}

// gpuMapFor resolves --gpu-map against the checkpoint's GPUs: OLD may also
// be written "all" when the checkpoint records one GPU.
func gpuMapFor(spec string, gpus []manifest.GPU) ([]vram.GPUPair, error) {
	if spec == "" {
		return nil, nil
	}
	if old, nw, ok := strings.Cut(spec, "="); ok && old == "all" {
		uuids := map[string]bool{}
		for _, g := range gpus {
			if g.UUID != "" {
				uuids[g.UUID] = true
			}
		}
		if len(uuids) != 1 {
			return nil, usagef("--gpu-map all=%s: the checkpoint records %d GPUs; name each OLD_UUID", nw, len(uuids))
		}
		for u := range uuids {
			spec = u + "=" + nw
		}
	}
	pairs, err := vram.ParseGPUMap(spec)
	if err != nil {
		return nil, usagef("--gpu-map: %v", err)
	}
	return pairs, nil
}

// runGPU is `gpucr-stream gpu ACTION --pid PID`: the driver's checkpoint
// steps one at a time (what cuda-checkpoint does), for scripts, debugging
// and the plain-CRIU baseline. Actions: info, state, lock, checkpoint,
// restore, unlock, suspend (lock + checkpoint of the tree), resume
// (restore + unlock of the tree).
func runGPU(ctx context.Context, cfg *config, args []string) error {
	if len(args) != 1 {
		return usagef("gpu needs one action: info, state, lock, checkpoint, restore, unlock, suspend, resume")
	}
	action := args[0]
	drv, err := openDriver()
	if err != nil {
		return err
	}
	v, _ := drv.Version()
	if action == "info" {
		info := map[string]any{"cuda_version": vram.VersionString(v), "library": vram.LibraryName}
		if gpus, err := vram.GPUs(ctx, nil); err == nil {
			info["gpus"] = gpus
		}
		if cfg.jsonOut {
			return json.NewEncoder(cfg.stdout).Encode(info)
		}
		fmt.Fprintf(cfg.stdout, "CUDA driver %s (%s), process checkpoint API present\n", vram.VersionString(v), vram.LibraryName)
		if gpus, ok := info["gpus"].([]vram.GPUInfo); ok {
			for _, g := range gpus {
				fmt.Fprintf(cfg.stdout, "  %s %s driver %s\n", g.UUID, g.Name, g.Driver)
			}
		}
		return nil
	}
	if cfg.pid <= 0 {
		return usagef("gpu %s needs --pid PID", action)
	}
	timeout, err := cfg.lockTimeoutDur()
	if err != nil {
		return err
	}
	var pairs []vram.GPUPair
	if cfg.gpuMap != "" {
		if pairs, err = vram.ParseGPUMap(cfg.gpuMap); err != nil {
			return usagef("--gpu-map: %v", err)
		}
	}
	pid := cfg.pid
	start := time.Now()
	out := map[string]any{"pid": pid, "action": action}
	switch action {
	case "state":
		st, err := drv.State(pid)
		if err != nil {
			return err
		}
		out["state"] = st.String()
	case "lock":
		err = drv.Lock(pid, timeout)
	case "checkpoint":
		err = drv.Checkpoint(pid)
	case "restore":
		err = drv.Restore(pid, pairs)
	case "unlock":
		err = drv.Unlock(pid)
	case "suspend", "resume":
		found, _, ferr := findCUDAProcs(pid)
		if ferr != nil {
			return ferr
		}
		var pids []int
		for _, u := range found {
			if _, serr := drv.State(u.PID); serr == nil {
				pids = append(pids, u.PID)
			}
		}
		if len(pids) == 0 {
			return fmt.Errorf("gpu %s: no CUDA process in the tree of %d", action, pid)
		}
		var t vram.Timings
		out["pids"] = pids
		switch {
		case action == "suspend" && cfg.to != "-":
			// The fast path: device memory into DEST (fastpath.go).
			out["phases"], err = gpuSuspendTo(ctx, cfg, drv, pids, timeout)
		case action == "resume" && cfg.from != "-":
			out["phases"], err = gpuResumeFrom(ctx, cfg, drv, pids, pairs)
		case action == "suspend":
			var s *vram.Suspension
			s, err = vram.Suspend(drv, pids, timeout)
			t = s.Timings
			out["phases"] = timingPhases(t)
		default:
			_, t, err = vram.ResumeRestored(drv, pids, pairs)
			out["phases"] = timingPhases(t)
		}
	default:
		return usagef("gpu: unknown action %q", action)
	}
	if err != nil {
		return err
	}
	out["seconds"] = time.Since(start).Seconds()
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(out)
	}
	if st, ok := out["state"]; ok {
		fmt.Fprintln(cfg.stdout, st)
		return nil
	}
	fmt.Fprintf(cfg.stdout, "gpu %s of %d done in %.3fs\n", action, pid, time.Since(start).Seconds())
	if ps, ok := out["phases"].([]phase); ok {
		for _, p := range ps {
			fmt.Fprintf(cfg.stdout, "  %-30s %7.3fs\n", p.Name, p.Secs)
		}
	}
	return nil
}

// timingPhases lists the non-zero driver steps.
func timingPhases(t vram.Timings) []phase {
	var ps []phase
	for _, p := range []phase{{"gpu lock", t.Lock.Seconds()}, {"gpu checkpoint", t.Checkpoint.Seconds()},
		{"gpu restore", t.Restore.Seconds()}, {"gpu unlock", t.Unlock.Seconds()}} {
		if p.Secs > 0 {
			ps = append(ps, p)
		}
	}
	return ps
}

// errGPUUndone explains a checkpoint that failed after the GPU step.
func errGPUUndone(cause error, pids []int, undoErr error) error {
	if undoErr != nil {
		return fmt.Errorf("%w; undoing the GPU step of %v failed too: %v", cause, pids, undoErr)
	}
	return fmt.Errorf("%w (GPU state of %v restored and unlocked: the process runs on)", cause, pids)
}
