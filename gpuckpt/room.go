package gpuckpt

// Room for the driver's checkpoint: it copies every byte of device memory
// a process holds into that process's own host memory, charged to its
// memory cgroup. Short of room the kernel OOM-kills the process in the
// middle of the checkpoint (seen on an H200: an inference-shaped process
// holding 133 GB, a 125 GiB host, killed 45 s in, its GPU state gone), so
// the checkpoint is refused before the driver's lock instead. Processes
// the fast path moved hold little device memory by then and are not
// counted.

import (
	"context"
	"fmt"
	"slices"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/hostroom"
)

// driverNeed is the device memory (bytes by pid) the driver's checkpoint
// will copy into host memory: nvidia-smi's count for each process the fast
// path did not move. Empty where nvidia-smi could not tell.
func (cc *Checkpoint) driverNeed(ctx context.Context) map[int]int64 {
	moved := map[int]bool{}
	if cc.fast != nil {
		for _, p := range cc.fast.Procs() {
			moved[p.PID] = true
		}
	}
	need := map[int]int64{}
	for _, g := range cc.GPUs(ctx) {
		if g.PID > 0 && g.Bytes > 0 && !moved[g.PID] {
			need[g.PID] += g.Bytes
		}
	}
	return need
}

// checkDriverRoom refuses a driver's checkpoint whose copy of the device
// memory would not fit in the host's memory or the processes' cgroups.
func (cc *Checkpoint) checkDriverRoom(ctx context.Context) error {
	need := cc.driverNeed(ctx)
	if len(need) == 0 {
		return nil
	}
	have, where, short := hostroom.Shortfall(need)
	if !short {
		return nil
	}
	var total int64
	for _, n := range need {
		total += n
	}
	return fmt.Errorf("the driver's checkpoint would copy %s of device memory into the host memory of processes %v, and %s has %s: refused before the GPU was locked, the processes run on (gpucr-stream run puts a process on the fast path, which keeps only what it wrote: docs/PRODUCERS.md section 3): %w",
		hostroom.Bytes(total), sortedPIDs(need), where, hostroom.Bytes(have), errdefs.ErrNoRoom)
}

func sortedPIDs(m map[int]int64) []int {
	pids := make([]int, 0, len(m))
	for p := range m {
		pids = append(pids, p)
	}
	slices.Sort(pids)
	return pids
}
