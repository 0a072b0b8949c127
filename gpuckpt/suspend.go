package gpuckpt

// Suspending a tree's GPU state, and bringing it back: the tables of
// steps that run on the one undo stack (undo.go). The fast path's steps
// (FastSuspend) run first where it is taken; the driver's (Suspend)
// follow; a failure anywhere undoes both, the driver's state first.

import (
	"context"
	"time"
)

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
	if testFault("gpu-checkpoint") {
		drv = faultyCheckpoint{drv}
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
