package gpuckpt

// The driver's steps of a suspend (lock, then checkpoint: device memory
// into host memory) and their undos (restore, then unlock), and the
// driver's resume of a restored tree. The undos revert exactly what the
// steps did: a process that someone else had locked or checkpointed is
// left so.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/cudadriver"
)

// DriverTimings are the wall-clock times of the driver's steps of a
// tree: locks and unlocks summed over its processes; checkpoints and
// restores, which run for all of them at once, the wall time of that
// step.
type DriverTimings struct {
	Lock       time.Duration
	Checkpoint time.Duration
	Restore    time.Duration
	Unlock     time.Duration
}

// driverSuspend is the driver's part of one suspend: the processes it
// locked and checkpointed, in that order, for the undos.
type driverSuspend struct {
	drv         cudadriver.Driver
	pids        []int
	lockTimeout time.Duration
	t           DriverTimings
	// locked: the pids the lock step locked; toCheckpoint: those locked
	// now (by it or before); checkpointed: those the checkpoint step
	// checkpointed.
	locked, toCheckpoint, checkpointed []int
	// refused are the processes whose restore the driver refused as not
	// supported (driver 580, an NCCL rank): likely to be refused again.
	refused []int
}

// lock locks every running process of the tree, all before any
// checkpoint (so that none runs on while another is copied out). A
// process already locked is only checkpointed later; one already
// checkpointed is left alone. Its time is the locks' alone.
func (d *driverSuspend) lock(context.Context) error {
	for _, pid := range d.pids {
		st, err := d.drv.State(pid)
		if err != nil {
			return err
		}
		switch st {
		case cudadriver.StateRunning:
			start := time.Now()
			err := d.drv.Lock(pid, d.lockTimeout)
			d.t.Lock += time.Since(start)
			if err != nil {
				return d.lockFailed(pid, err)
			}
			d.locked = append(d.locked, pid)
			d.toCheckpoint = append(d.toCheckpoint, pid)
		case cudadriver.StateLocked:
			d.toCheckpoint = append(d.toCheckpoint, pid)
		case cudadriver.StateCheckpointed:
		default:
			return fmt.Errorf("cuda process %d is in state %s; it cannot be checkpointed", pid, st)
		}
	}
	return nil
}

// lockFailed explains a lock that failed: the tree is locked all or
// nothing, so the processes this step locked before pid are unlocked at
// once (its undo; failed then checks that they run).
func (d *driverSuspend) lockFailed(pid int, err error) error {
	hint := ""
	var ve *cudadriver.Error
	if errors.As(err, &ve) && ve.Code == cudadriver.ErrorNotReady {
		hint = " (its GPU work does not drain: a collective that waits for a process locked before it)"
	}
	if len(d.locked) == 0 {
		return fmt.Errorf("locking the tree's CUDA processes %v all or nothing: process %d could not be locked%s: %w", d.pids, pid, hint, err)
	}
	return fmt.Errorf("locking the tree's CUDA processes %v all or nothing: process %d could not be locked%s, so process %s, locked before it, is unlocked at once: %w",
		d.pids, pid, hint, joinInts(d.locked), err)
}

// unlock unlocks what lock locked, the last first, trying every one.
func (d *driverSuspend) unlock(context.Context) error {
	var errs []error
	for i := len(d.locked) - 1; i >= 0; i-- {
		start := time.Now()
		errs = append(errs, d.drv.Unlock(d.locked[i]))
		d.t.Unlock += time.Since(start)
	}
	d.locked = nil
	return errors.Join(errs...)
}

// checkpoint checkpoints every locked process at once: each moves its
// own state, ranks usually on GPUs of their own; one after the other, a
// tree waits for the sum.
func (d *driverSuspend) checkpoint(context.Context) error {
	errs := eachAtOnce(d.toCheckpoint, d.drv.Checkpoint)
	for i, pid := range d.toCheckpoint {
		if errs[i] == nil {
			d.checkpointed = append(d.checkpointed, pid)
		}
	}
	return errors.Join(errs...)
}

// restore restores what checkpoint checkpointed, the last first, trying
// every one.
func (d *driverSuspend) restore(context.Context) error {
	var errs []error
	for i := len(d.checkpointed) - 1; i >= 0; i-- {
		pid := d.checkpointed[i]
		start := time.Now()
		err := d.drv.Restore(pid, nil)
		d.t.Restore += time.Since(start)
		var ve *cudadriver.Error
		if errors.As(err, &ve) && ve.Code == cudadriver.ErrorNotSupported {
			d.refused = append(d.refused, pid)
		}
		errs = append(errs, err)
	}
	d.checkpointed = nil
	return errors.Join(errs...)
}

// faultyCheckpoint fails the driver's checkpoint step with err before it
// reaches the driver (testhook.Fault("gpu-checkpoint")): the GPU
// machine's fault round locks a real tree and sees it unlocked again,
// without the checkpoint that the driver could not undo for an NCCL rank.
type faultyCheckpoint struct {
	cudadriver.Driver
	err error
}

func (f faultyCheckpoint) Checkpoint(pid int) error {
	return fmt.Errorf("cuda checkpoint of pid %d: %w", pid, f.err)
}

// eachAtOnce runs step for every pid at once and returns their errors in
// the order of pids.
func eachAtOnce(pids []int, step func(int) error) []error {
	errs := make([]error, len(pids))
	var wg sync.WaitGroup
	for i, pid := range pids {
		wg.Go(func() { errs[i] = step(pid) })
	}
	wg.Wait()
	return errs
}

// resumeRestored brings the CUDA processes of a restored tree back onto
// the GPU: every checkpointed one is restored (onto the GPUs pairs name;
// all at once) and then every one left locked is unlocked, all restores
// before any unlock. Processes already running are left alone. It
// returns the pids it resumed.
func resumeRestored(d cudadriver.Driver, pids []int, pairs []cudadriver.GPUPair) ([]int, DriverTimings, error) {
	var t DriverTimings
	var toRestore, toUnlock, resumed []int
	for _, pid := range pids {
		st, err := d.State(pid)
		if err != nil {
			return resumed, t, err
		}
		switch st {
		case cudadriver.StateCheckpointed:
			toRestore = append(toRestore, pid)
			toUnlock = append(toUnlock, pid)
		case cudadriver.StateLocked:
			toUnlock = append(toUnlock, pid)
		case cudadriver.StateRunning:
		default:
			return resumed, t, fmt.Errorf("restored cuda process %d is in state %s", pid, st)
		}
	}
	start := time.Now()
	errs := eachAtOnce(toRestore, func(pid int) error { return d.Restore(pid, pairs) })
	t.Restore += time.Since(start)
	if err := errors.Join(errs...); err != nil {
		return resumed, t, err
	}
	for _, pid := range toUnlock {
		start := time.Now()
		err := d.Unlock(pid)
		t.Unlock += time.Since(start)
		if err != nil {
			return resumed, t, err
		}
		resumed = append(resumed, pid)
	}
	return resumed, t, nil
}

// TimingPhases lists the non-zero driver steps.
func TimingPhases(t DriverTimings) []Phase {
	var ps []Phase
	for _, p := range []Phase{{"gpu lock", t.Lock.Seconds()}, {"gpu checkpoint", t.Checkpoint.Seconds()},
		{"gpu restore", t.Restore.Seconds()}, {"gpu unlock", t.Unlock.Seconds()}} {
		if p.Secs > 0 {
			ps = append(ps, p)
		}
	}
	return ps
}
