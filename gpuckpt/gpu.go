package gpuckpt

import (
	"context"
	"fmt"
	"time"

	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/scratch"
	"github.com/gpucr/gpucr-stream/vram"
)

// DriverInfo describes the CUDA driver and the GPUs.
type DriverInfo struct {
	CUDAVersion string               `json:"cuda_version"`
	Library     string               `json:"library"`
	GPUs        []cudadriver.GPUInfo `json:"gpus,omitempty"`
}

// GPUInfo describes drv and the GPUs nvidia-smi lists (none if it fails).
func GPUInfo(ctx context.Context, drv cudadriver.Driver) DriverInfo {
	v, _ := drv.Version()
	info := DriverInfo{CUDAVersion: cudadriver.VersionString(v), Library: cudadriver.LibraryName}
	if gpus, err := cudadriver.GPUs(ctx, nil); err == nil {
		info.GPUs = gpus
	}
	return info
}

// GPUStepOptions are one driver step's.
type GPUStepOptions struct {
	// Action is state, lock, checkpoint, restore, unlock, suspend (lock +
	// checkpoint of the tree) or resume (restore + unlock of the tree).
	Action      string
	PID         int
	LockTimeout time.Duration
	Pairs       []cudadriver.GPUPair
	// FindProcs finds the CUDA processes of a tree (nil: cudadriver.FindCUDA).
	FindProcs func(root int) ([]cudadriver.Usage, []int, error)
	// To (suspend) and From (resume), where not stdio, take the fast path
	// (vramfiles.go): the device memory of processes that run with
	// libgpucr-preload goes into a checkpoint at To and comes back from
	// one at From; Open opens them, FastPath configures the copy, Tool is
	// recorded in the manifest.
	To, From location.Location
	Open     location.Config
	FastPath FastPath
	Tool     string
	// Stage is the memory resume --from may read VRAM files ahead into.
	Stage StageMemory
	// HostCheck (hash) hashes every block on the host too.
	HostCheck bool
	// Log takes diagnostic lines (may be nil).
	Log func(string)
}

// GPUStepResult is what a step did.
type GPUStepResult struct {
	PID     int     `json:"pid"`
	Action  string  `json:"action"`
	State   string  `json:"state,omitempty"`
	PIDs    []int   `json:"pids,omitempty"`
	Phases  []Phase `json:"phases,omitempty"`
	Seconds float64 `json:"seconds"`
	// suspend --to: when the fast path had released the device memory,
	// and when the driver's checkpoint had freed the rest, in seconds from
	// the start; the command returns (Seconds) once the checkpoint is
	// committed.
	MemoryReleasedSecs float64 `json:"memory_released_seconds,omitempty"`
	DeviceFreedSecs    float64 `json:"device_freed_seconds,omitempty"`
	// hash: the device memory of PID hashed on the device, and copied out
	// and hashed on the host.
	Hash *vram.HashReport `json:"hash,omitempty"`
}

// GPUStep runs one of the driver's checkpoint steps on o.PID (what
// cuda-checkpoint does), or suspends or resumes the CUDA processes of its
// tree, for scripts, debugging and the plain-CRIU baseline.
func GPUStep(ctx context.Context, drv cudadriver.Driver, o GPUStepOptions) (*GPUStepResult, error) {
	start := time.Now()
	res := &GPUStepResult{PID: o.PID, Action: o.Action}
	if o.To.Kind != location.Stdio && o.Action != "suspend" {
		return nil, errdefs.Usagef("gpu %s does not take --to (gpu suspend --to DEST)", o.Action)
	}
	if o.From.Kind != location.Stdio && o.Action != "resume" {
		return nil, errdefs.Usagef("gpu %s does not take --from (gpu resume --from SRC)", o.Action)
	}
	var err error
	switch o.Action {
	case "state":
		var st cudadriver.State
		if st, err = drv.State(o.PID); err == nil {
			res.State = st.String()
		}
	case "lock":
		err = drv.Lock(o.PID, o.LockTimeout)
	case "checkpoint":
		err = drv.Checkpoint(o.PID)
	case "restore":
		err = drv.Restore(o.PID, o.Pairs)
	case "unlock":
		err = drv.Unlock(o.PID)
	case "suspend", "resume":
		err = treeStep(ctx, drv, o, start, res)
	case "hash":
		res.Hash, err = hashStep(ctx, o)
	default:
		return nil, errdefs.Usagef("gpu: unknown action %q", o.Action)
	}
	if err != nil {
		return nil, err
	}
	res.Seconds = time.Since(start).Seconds()
	return res, nil
}

// treeStep suspends or resumes every CUDA process of o.PID's tree; with
// o.To or o.From, through the fast path.
func treeStep(ctx context.Context, drv cudadriver.Driver, o GPUStepOptions, start time.Time, res *GPUStepResult) error {
	found, _, err := CUDA{FindProcs: o.FindProcs}.find(o.PID)
	if err != nil {
		return err
	}
	var pids []int
	for _, u := range found {
		if _, serr := drv.State(u.PID); serr == nil {
			pids = append(pids, u.PID)
		}
	}
	if len(pids) == 0 {
		return fmt.Errorf("gpu %s: no CUDA process in the tree of %d", o.Action, o.PID)
	}
	res.PIDs = pids
	if o.Action == "suspend" {
		if err := CheckUndoable(ctx, pids, o.To.Kind != location.Stdio && o.FastPath.Mode != FastPathOff); err != nil {
			return fmt.Errorf("gpu suspend: %w", err)
		}
	}
	switch {
	case o.Action == "suspend" && o.To.Kind != location.Stdio:
		res.Phases, err = suspendTo(ctx, drv, pids, o, start, res)
	case o.Action == "resume" && o.From.Kind != location.Stdio:
		res.Phases, err = resumeFrom(ctx, drv, pids, o)
	case o.Action == "suspend":
		res.Phases, err = (&Checkpoint{drv: drv, pids: pids}).Suspend(ctx, o.LockTimeout)
	default:
		var t DriverTimings
		_, t, err = resumeRestored(drv, pids, o.Pairs)
		res.Phases = TimingPhases(t)
		if err == nil {
			// A process the fast path left parked (gpucr-stream died after
			// the driver's lock) gets its memory back from the kept copy.
			start := time.Now()
			var rec []int
			rec, err = vram.FastRecover(ctx, preloadctl.Dir(), "", pids, openEarlier(o.Open))
			if len(rec) > 0 {
				res.Phases = append(res.Phases, Phase{"vram refill", time.Since(start).Seconds()})
			}
		}
	}
	return err
}

// hashStep measures, on o.PID alone, finding changed device memory by
// hashing it on the device against copying it out (into a scratch
// directory as the kept copy's) and hashing it on the host.
func hashStep(ctx context.Context, o GPUStepOptions) (*vram.HashReport, error) {
	rep, err := preloadReport(ctx, o.PID)
	if err != nil {
		return nil, fmt.Errorf("gpu hash: process %d runs without libgpucr-preload (gpucr-stream run): %w", o.PID, err)
	}
	dir, err := scratch.New(scratch.DefaultRoot, o.FastPath.KeepDir, "gpucr-hash-", rep.Bytes)
	if err != nil {
		return nil, fmt.Errorf("gpu hash: %w", err)
	}
	defer dir.Remove()
	r, err := vram.HashDevice(ctx, preloadctl.Dir(), o.PID, vram.HashOptions{Check: o.HostCheck, Scratch: dir.File(), Files: o.FastPath.Files})
	if err != nil {
		return nil, fmt.Errorf("gpu hash: %w", err)
	}
	return &r, nil
}
