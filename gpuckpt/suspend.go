package gpuckpt

// Suspending a tree's GPU state, and bringing it back: the tables of
// steps that run on the one undo stack (undo.go). The fast path's steps
// (FastSuspend) run first where it is taken; the driver's (Suspend)
// follow; a failure anywhere undoes both, the driver's state first.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/testhook"
	"github.com/gpucr/gpucr-stream/vram"
)

// fastSteps is the fast path's table (vram has each step and its
// inverse; docs/PRODUCERS.md section 3 the order and why): the device
// memory of f's processes goes into a kept copy and is released, and the
// store of the kept copy starts. A step that needs no undo of its own
// has none: the collective barrier ends with the unpark or the
// connection, the release is undone by the park's undo (the library's
// recover remaps, refills and unparks at once), what the room step and
// the copy out write is removed by the kept copy's undo, which runs last
// (after the refill read the copy, and after the store let go of it).
func (cc *Checkpoint) fastSteps(f *vram.FastSuspension) []step {
	t := &cc.fastT
	return []step{
		{name: "kept copy", do: f.OpenKeep, undo: cc.removeKeep, fast: true},
		{name: "connect", do: f.Dial, undo: f.HangUp, fast: true},
		{name: "earlier checkpoint", took: &t.earlier, do: f.FindEarlier, undo: cc.earlier.end},
		{name: "stage", took: &t.stage, do: f.Stage},
		{name: "collective barrier", took: &t.park, do: f.HoldCollectives},
		{name: "park", took: &t.park, do: f.Park, undo: f.Refill, fast: true},
		{name: "match shared memory", do: f.MatchShared},
		{name: "sweep stale records", do: f.SweepRecords},
		{name: "zero scan", took: &t.scan, do: f.Scan},
		{name: "unchanged blocks", took: &t.unchanged, do: f.Unchanged},
		{name: "room for the kept copy", do: f.Room},
		{name: "copy out", took: &t.copyOut, do: f.CopyOut},
		{name: "release", took: &t.release, do: f.Release},
		{name: "store", do: f.StartStore, undo: f.StopStore, fast: true},
	}
}

// fastTimings are the fast path's steps as its table timed them: with
// --dedup the look for earlier checkpoints (the processes still run), the
// staging of the copy threads' pinned buffers, the park (the collective
// barrier and the parks), the zero scans, with --dedup the blocks found
// unchanged (the device's hashes, the comparison), the copy out (every process at once) and the
// release.
type fastTimings struct {
	earlier, stage, park, scan, unchanged, copyOut, release time.Duration
}

// moveOut runs the fast path's table for cc's processes (FastSuspend),
// their VRAM files stored with put. On failure it has undone its steps,
// and the error says whether that failed too.
func (cc *Checkpoint) moveOut(ctx context.Context, put vram.PutFunc, o vram.FastOptions) error {
	f, err := vram.NewFastSuspension(cc.pids, put, o)
	if err != nil {
		return err
	}
	cc.fast = f
	if err := cc.undo.run(ctx, cc.fastSteps(f)); err != nil {
		if u := cc.undo.unwind(ctx); u.err != nil {
			return errors.Join(err, fmt.Errorf("undo failed, device memory of the process may be missing: %w", u.err))
		}
		return err
	}
	return nil
}

// removeKeep is the kept copy's undo: the copy goes (once the store let
// go of it), and the scratch directory made for it.
func (cc *Checkpoint) removeKeep(ctx context.Context) error {
	err := cc.fast.RemoveKeep(ctx)
	if cc.fast.Stranded() {
		return err // a refill failed: its copy stays for `gpu resume --pid`
	}
	return errors.Join(err, cc.keepDir.Remove())
}

// fastPhases are the fast path's steps as timed, the parts of the slowest
// process's copy out, and each process's copy where there are several.
func (cc *Checkpoint) fastPhases(gpus []manifest.GPU) []Phase {
	t := cc.fastT
	procs := cc.fast.Procs()
	var phases []Phase
	if cc.earlier != nil {
		phases = append(phases, Phase{"vram earlier checkpoint (process running)", t.earlier.Seconds()})
	}
	phases = append(phases, Phase{"vram stage (process running)", t.stage.Seconds()}, Phase{"vram park", t.park.Seconds()},
		Phase{"vram zero scan", t.scan.Seconds()})
	if cc.earlier != nil {
		phases = append(phases, Phase{"vram unchanged blocks", t.unchanged.Seconds()})
	}
	phases = append(phases, Phase{"vram copy out", t.copyOut.Seconds()}, Phase{"vram release", t.release.Seconds()})
	phases = append(phases, copyPhases("copy out", slowest(procs))...)
	return append(phases, perProcess("copy out", procs, gpus)...)
}

// slowest is the copy out of the process that took longest (the last of
// equals).
func slowest(procs []vram.FastProc) preloadctl.CopyStats {
	var c preloadctl.CopyStats
	for _, p := range procs {
		if p.Copy.Work >= c.Work {
			c = p.Copy
		}
	}
	return c
}

// Suspend moves the GPU state of cc's processes into host memory (lock,
// then checkpoint), so that CRIU can dump them. The tree is locked all or
// nothing: a process that cannot be locked has the others unlocked at
// once. On failure every step is undone, the fast path's too (the memory
// it released comes back): the processes run on, or the error is a
// StuckError saying where each is left. The fast path's libraries hear of
// the driver's lock before it, and are detached after the checkpoint.
func (cc *Checkpoint) Suspend(ctx context.Context, lockTimeout time.Duration) ([]Phase, error) {
	if cc == nil {
		return nil, nil
	}
	drv := cc.drv
	if err := testhook.Fault("gpu-checkpoint"); err != nil {
		drv = faultyCheckpoint{drv, err}
	}
	d := &driverSuspend{drv: drv, pids: cc.pids, lockTimeout: lockTimeout}
	cc.driver = d
	steps := []step{{name: "room for the driver's checkpoint", do: cc.checkDriverRoom}}
	if cc.fast != nil {
		steps = append(steps, step{name: "driver's lock announced", do: cc.fast.BeforeDriver})
	}
	steps = append(steps,
		step{name: "driver lock", do: d.lock, undo: d.unlock},
		step{name: "driver checkpoint", took: &d.t.Checkpoint, do: d.checkpoint, undo: d.restore})
	if cc.fast != nil {
		steps = append(steps, step{name: "detach", do: cc.fast.Detach})
	}
	err := cc.undo.run(ctx, steps)
	if err != nil && !cc.undo.empty() {
		err = cc.failed(err, cc.undo.unwind(ctx))
	}
	return TimingPhases(d.t), err
}

// Undo is for a dump that failed after Suspend: CRIU resumed the process
// (or never stopped it), so its GPU state must come back too. It returns
// cause, saying whether that worked (a StuckError if not). The driver's
// state comes back first, then the memory the fast path released.
func (cc *Checkpoint) Undo(cause error) error {
	if cc == nil {
		return cause
	}
	return cc.failed(cause, cc.undo.unwind(context.Background()))
}

// Resume puts the GPU state back after a committed dump that left the
// process running, and times the driver steps and the fast path's refill.
// A failure is a StuckError.
func (cc *Checkpoint) Resume() ([]Phase, error) {
	if cc == nil {
		return nil, nil
	}
	var before DriverTimings
	if cc.driver != nil {
		before = cc.driver.t
	}
	u := cc.undo.unwind(context.Background())
	var ps []Phase
	if cc.driver != nil {
		t := cc.driver.t
		ps = TimingPhases(DriverTimings{Restore: t.Restore - before.Restore, Unlock: t.Unlock - before.Unlock})
	}
	if cc.fast != nil {
		ps = append(ps, Phase{"vram refill", u.fastTook.Seconds()})
	}
	if u.err != nil {
		states, _ := procStates(cc.drv, cc.pids, u.fast != nil)
		cc.refused(states)
		return ps, &StuckError{Undo: u.err, Procs: states}
	}
	return ps, nil
}
