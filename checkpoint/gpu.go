package checkpoint

import (
	"context"
	"fmt"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/vram"
)

// DriverInfo describes the CUDA driver and the GPUs.
type DriverInfo struct {
	CUDAVersion string         `json:"cuda_version"`
	Library     string         `json:"library"`
	GPUs        []vram.GPUInfo `json:"gpus,omitempty"`
}

// GPUInfo describes drv and the GPUs nvidia-smi lists (none if it fails).
func GPUInfo(ctx context.Context, drv vram.Driver) DriverInfo {
	v, _ := drv.Version()
	info := DriverInfo{CUDAVersion: vram.VersionString(v), Library: vram.LibraryName}
	if gpus, err := vram.GPUs(ctx, nil); err == nil {
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
	Pairs       []vram.GPUPair
	// FindProcs finds the CUDA processes of a tree (nil: vram.FindCUDA).
	FindProcs func(root int) ([]vram.Usage, []int, error)
}

// GPUStepResult is what a step did.
type GPUStepResult struct {
	PID     int     `json:"pid"`
	Action  string  `json:"action"`
	State   string  `json:"state,omitempty"`
	PIDs    []int   `json:"pids,omitempty"`
	Phases  []Phase `json:"phases,omitempty"`
	Seconds float64 `json:"seconds"`
}

// GPUStep runs one of the driver's checkpoint steps on o.PID (what
// cuda-checkpoint does), or suspends or resumes the CUDA processes of its
// tree, for scripts, debugging and the plain-CRIU baseline.
func GPUStep(drv vram.Driver, o GPUStepOptions) (*GPUStepResult, error) {
	start := time.Now()
	res := &GPUStepResult{PID: o.PID, Action: o.Action}
	var err error
	switch o.Action {
	case "state":
		var st vram.State
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
		err = treeStep(drv, o, res)
	default:
		return nil, errdefs.Usagef("gpu: unknown action %q", o.Action)
	}
	if err != nil {
		return nil, err
	}
	res.Seconds = time.Since(start).Seconds()
	return res, nil
}

// treeStep suspends or resumes every CUDA process of o.PID's tree.
func treeStep(drv vram.Driver, o GPUStepOptions, res *GPUStepResult) error {
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
	var t vram.Timings
	if o.Action == "suspend" {
		var s *vram.Suspension
		s, err = vram.Suspend(drv, pids, o.LockTimeout)
		t = s.Timings
	} else {
		_, t, err = vram.ResumeRestored(drv, pids, o.Pairs)
	}
	res.PIDs, res.Phases = pids, TimingPhases(t)
	return err
}
