package gpuckpt

// The one undo stack of a GPU suspend. Suspending a tree is a table of
// steps (suspend.go: the fast path's, then the driver's), each with the
// undo that reverts it. A step's undo goes on the stack as the step
// begins, and reverts whatever part of it took effect: a step that fails
// halfway (the second of three processes could not be locked) is undone
// as well as those before it. The stack is undone, the last step first,
// when a step fails, when the dump fails after the suspend (Undo), and
// after a committed dump that leaves the processes running (Resume); a
// committed dump whose processes are gone forgets it. The stack is what
// the undo knows: no step has to be worked out afterwards from an error.

import (
	"context"
	"errors"
	"time"
)

// step is one step of a suspend.
type step struct {
	name string
	// took, if not nil, gets the step's wall time added (a phase of the
	// JSON output; several steps may add to one).
	took *time.Duration
	do   func(ctx context.Context) error
	// undo reverts what of do took effect; nil where there is nothing
	// to revert, or a step below reverts it (the fast path's release is
	// undone by its park's undo: the library's recover remaps, refills
	// and unparks in one command).
	undo func(ctx context.Context) error
	// fast: the undo brings the fast path's device memory back (a
	// failure may leave a process without it), not the driver's state.
	fast bool
}

// undoStack holds the steps begun that have an undo, in order.
type undoStack struct {
	steps []step
}

// run does steps in order, timing each and pushing its undo as it
// begins, and stops at the first failure, which it returns: the caller
// undoes (unwind), knowing what the failure means to its user.
func (u *undoStack) run(ctx context.Context, steps []step) error {
	for _, s := range steps {
		if s.undo != nil {
			u.steps = append(u.steps, s)
		}
		start := time.Now()
		err := s.do(ctx)
		if s.took != nil {
			*s.took += time.Since(start)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// empty says that nothing is to be undone.
func (u *undoStack) empty() bool { return len(u.steps) == 0 }

// undone is what an unwind did: the errors of every undo, those of the
// fast path's alone (device memory that may not be back), and the time
// the fast path's undos took.
type undone struct {
	err, fast error
	fastTook  time.Duration
}

// unwind undoes every step on the stack, the last first, trying each even
// after one failed, and empties it: a second unwind does nothing. It runs
// even when ctx was cancelled (the processes must come back).
func (u *undoStack) unwind(ctx context.Context) undone {
	ctx = context.WithoutCancel(ctx)
	var all, fast []error
	var res undone
	for i := len(u.steps) - 1; i >= 0; i-- {
		s := u.steps[i]
		start := time.Now()
		err := s.undo(ctx)
		if s.fast {
			res.fastTook += time.Since(start)
			fast = append(fast, err)
		}
		all = append(all, err)
	}
	u.steps = nil
	res.err, res.fast = errors.Join(all...), errors.Join(fast...)
	return res
}

// forget drops the stack without undoing it: the dump is committed and
// its processes are gone, or stay suspended on purpose.
func (u *undoStack) forget() { u.steps = nil }
