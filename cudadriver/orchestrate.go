package cudadriver

import (
	"errors"
	"fmt"
	"sync"
	"time"
)

// Timings are the wall-clock times of the driver steps of a tree: locks
// and unlocks summed over its processes; checkpoints and restores, which
// run for all of them at once, the wall time of that step.
type Timings struct {
	Lock       time.Duration
	Checkpoint time.Duration
	Restore    time.Duration
	Unlock     time.Duration
}

// Suspension is the GPU state of a process tree that Suspend locked and
// checkpointed, and what it takes to undo that.
type Suspension struct {
	d Driver
	// PIDs are the CUDA processes, in the order they were suspended.
	PIDs []int
	// locked: pids this suspension locked (and must unlock); checkpointed:
	// pids it checkpointed (and must restore). A process that was already
	// locked or checkpointed before is left so.
	locked, checkpointed []int
	Timings              Timings
	resumed              bool
}

// Suspend brings every CUDA process in pids to the checkpointed state: it
// locks them all first (so that none runs on while another is copied out),
// then checkpoints them all. A process already locked is only
// checkpointed; one already checkpointed is left alone. On failure it
// undoes what it did, in reverse order (restore what it checkpointed,
// then unlock what it locked), so that the processes run on as before, and
// returns the error together with any error of the undo.
func Suspend(d Driver, pids []int, lockTimeout time.Duration) (*Suspension, error) {
	s := &Suspension{d: d, PIDs: pids}
	var toCheckpoint []int
	for _, pid := range pids {
		st, err := d.State(pid)
		if err != nil {
			return s, s.undo(err)
		}
		switch st {
		case StateRunning:
			start := time.Now()
			err := d.Lock(pid, lockTimeout)
			s.Timings.Lock += time.Since(start)
			if err != nil {
				return s, s.undo(err)
			}
			s.locked = append(s.locked, pid)
			toCheckpoint = append(toCheckpoint, pid)
		case StateLocked:
			toCheckpoint = append(toCheckpoint, pid)
		case StateCheckpointed:
		default:
			return s, s.undo(fmt.Errorf("cuda process %d is in state %s; it cannot be checkpointed", pid, st))
		}
	}
	// Every process is locked: their checkpoints run at once (each moves
	// its own state, ranks usually on GPUs of their own; one after the
	// other, a tree waits for the sum).
	start := time.Now()
	errs := eachAtOnce(toCheckpoint, d.Checkpoint)
	s.Timings.Checkpoint += time.Since(start)
	for i, pid := range toCheckpoint {
		if errs[i] == nil {
			s.checkpointed = append(s.checkpointed, pid)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return s, s.undo(err)
	}
	return s, nil
}

// eachAtOnce runs step for every pid at once and returns their errors in
// the order of pids.
func eachAtOnce(pids []int, step func(int) error) []error {
	errs := make([]error, len(pids))
	var wg sync.WaitGroup
	for i, pid := range pids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = step(pid)
		}()
	}
	wg.Wait()
	return errs
}

// undo reverts a partial suspension and returns cause joined with any
// error of the undo itself.
func (s *Suspension) undo(cause error) error {
	if err := s.Resume(nil); err != nil {
		return errors.Join(cause, fmt.Errorf("undo failed, the GPU state of the process may be left suspended: %w", err))
	}
	return cause
}

// Resume restores what Suspend checkpointed, then unlocks what it locked,
// each in reverse order, so that the processes run on as before (after a
// failed dump, or with --leave-running). It tries every step even after a
// failure and returns all errors. A second call does nothing.
func (s *Suspension) Resume(pairs []GPUPair) error {
	if s == nil || s.resumed {
		return nil
	}
	s.resumed = true
	var errs []error
	for i := len(s.checkpointed) - 1; i >= 0; i-- {
		start := time.Now()
		if err := s.d.Restore(s.checkpointed[i], pairs); err != nil {
			errs = append(errs, err)
		}
		s.Timings.Restore += time.Since(start)
	}
	for i := len(s.locked) - 1; i >= 0; i-- {
		start := time.Now()
		if err := s.d.Unlock(s.locked[i]); err != nil {
			errs = append(errs, err)
		}
		s.Timings.Unlock += time.Since(start)
	}
	return errors.Join(errs...)
}

// ResumeRestored brings the CUDA processes of a restored tree back onto the
// GPU: every checkpointed one is restored (onto the GPUs pairs name; all at
// once) and then every one left locked is unlocked, all restores before any
// unlock.
// Processes already running are left alone. It returns the pids it
// resumed.
func ResumeRestored(d Driver, pids []int, pairs []GPUPair) ([]int, Timings, error) {
	var t Timings
	var toRestore, toUnlock, resumed []int
	for _, pid := range pids {
		st, err := d.State(pid)
		if err != nil {
			return resumed, t, err
		}
		switch st {
		case StateCheckpointed:
			toRestore = append(toRestore, pid)
			toUnlock = append(toUnlock, pid)
		case StateLocked:
			toUnlock = append(toUnlock, pid)
		case StateRunning:
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
