package gpuckpt

// A GPU step that failed, and its undo. The undo is tried at once; when it
// fails too, what the user needs is where each process is left and the
// command that brings it back, asked of the driver then and there
// (cuCheckpointProcessGetState), not guessed from the steps that ran.

import (
	"fmt"
	"strings"

	"github.com/gpucr/gpucr-stream/cudadriver"
)

// ProcState is where one CUDA process is left after a failed undo, and the
// command that brings it back ("" where none can).
type ProcState struct {
	PID     int    `json:"pid"`
	State   string `json:"state"`
	Recover string `json:"recover,omitempty"`
}

// StuckError is a GPU step whose undo failed: Procs says where each CUDA
// process of the tree is left.
type StuckError struct {
	// Cause is the failure that was undone (nil: a resume after a commit,
	// nothing to undo).
	Cause error
	Undo  error
	Procs []ProcState
}

func (e *StuckError) Error() string {
	pids := make([]int, len(e.Procs))
	var left []string
	for i, p := range e.Procs {
		pids[i] = p.PID
		s := fmt.Sprintf("process %d is %s", p.PID, p.State)
		if p.Recover != "" {
			s += ": " + p.Recover
		}
		left = append(left, s)
	}
	undo := "a process is not back"
	if e.Undo != nil {
		undo = strings.ReplaceAll(e.Undo.Error(), "\n", "; ")
	}
	if e.Cause == nil {
		return fmt.Sprintf("%s. Left so: %s", undo, strings.Join(left, "; "))
	}
	return fmt.Sprintf("%v; undoing the GPU step of %v failed too: %s. Left so: %s", e.Cause, pids, undo, strings.Join(left, "; "))
}

func (e *StuckError) Unwrap() []error { return []error{e.Cause, e.Undo} }

// procStates asks the driver where each of pids is, and says how to bring
// it back; parked: the fast path's refill failed, so processes the driver
// sees running may still be without their device memory. stuck says
// whether any is not back.
func procStates(drv cudadriver.Driver, pids []int, parked bool) (states []ProcState, stuck bool) {
	for _, pid := range pids {
		p := ProcState{PID: pid}
		st, err := drv.State(pid)
		switch {
		case err != nil:
			p.State = "unknown (" + err.Error() + ")"
			p.Recover = fmt.Sprintf("see `gpucr-stream gpu state --pid %d`", pid)
		case st == cudadriver.StateRunning && parked:
			p.State = "running, its device memory released by the GPU fast path"
			p.Recover = fmt.Sprintf("`gpucr-stream gpu resume --pid %d` refills it from the kept copy", pid)
		case st == cudadriver.StateRunning:
			p.State = st.String()
		case st == cudadriver.StateLocked:
			p.State = st.String()
			p.Recover = fmt.Sprintf("`gpucr-stream gpu unlock --pid %d`", pid)
		case st == cudadriver.StateCheckpointed:
			p.State = st.String()
			p.Recover = fmt.Sprintf("`gpucr-stream gpu restore --pid %d`, then `gpucr-stream gpu unlock --pid %d`", pid, pid)
		default:
			p.State = st.String()
			p.Recover = fmt.Sprintf("none: the driver lost its GPU state; stop it (kill %d)", pid)
		}
		stuck = stuck || p.Recover != ""
		states = append(states, p)
	}
	return states, stuck
}

// failed explains a GPU step that failed with cause, after the undo u:
// every process back, or a StuckError.
func (cc *Checkpoint) failed(cause error, u undone) error {
	states, stuck := procStates(cc.drv, cc.pids, u.fast != nil)
	if u.err == nil && !stuck {
		return fmt.Errorf("%w (GPU state of %v restored and unlocked: the process runs on)", cause, cc.pids)
	}
	cc.refused(states)
	return &StuckError{Cause: cause, Undo: u.err, Procs: states}
}

// refused adds to states what the driver's refusals of the undo's
// restores mean: a restore it did not support (driver 580, for an NCCL
// rank) is likely to be refused again.
func (cc *Checkpoint) refused(states []ProcState) {
	if cc.driver == nil {
		return
	}
	for _, pid := range cc.driver.refused {
		for i := range states {
			if states[i].PID == pid && states[i].Recover != "" {
				states[i].Recover += " (the driver refused this restore once, CUDA_ERROR_NOT_SUPPORTED: if it does again, stopping the process is all that is left)"
			}
		}
	}
}
