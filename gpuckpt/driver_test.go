package gpuckpt

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/cudadriver"
)

// TestSuspendResume: the tree is locked, then checkpointed; Resume
// restores and then unlocks, each in reverse order, and a second Resume
// does nothing.
func TestSuspendResume(t *testing.T) {
	d := newScripted(nil, 10, 11)
	cc := &Checkpoint{drv: d, pids: []int{10, 11}}
	ps, err := cc.Suspend(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := d.log(), "lock 10, lock 11, checkpoint 10, checkpoint 11"; got != want {
		t.Fatalf("calls %q, want %q", got, want)
	}
	if len(ps) != 2 || ps[0].Name != "gpu lock" || ps[1].Name != "gpu checkpoint" {
		t.Fatalf("phases %v, want the lock and the checkpoint", ps)
	}
	ps, err = cc.Resume()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := d.log(), "lock 10, lock 11, checkpoint 10, checkpoint 11, restore 11, restore 10, unlock 11, unlock 10"; got != want {
		t.Fatalf("calls %q, want %q", got, want)
	}
	if len(ps) != 2 || ps[0].Name != "gpu restore" || ps[1].Name != "gpu unlock" {
		t.Fatalf("phases %v, want the restore and the unlock", ps)
	}
	if _, err := cc.Resume(); err != nil || strings.Count(d.log(), "restore") != 2 {
		t.Fatalf("second Resume did something: %v, %s", err, d.log())
	}
	for _, p := range []int{10, 11} {
		if st := d.StateOf(p); st != cudadriver.StateRunning {
			t.Errorf("pid %d left %s", p, st)
		}
	}
}

// TestSuspendUndo: whatever driver step fails, every process ends
// running, with restores before unlocks, each in reverse order.
func TestSuspendUndo(t *testing.T) {
	cases := []struct {
		fail string
		want string
	}{
		{"lock 10", "lock 10"},
		{"lock 11", "lock 10, lock 11, unlock 10"},
		{"lock 12", "lock 10, lock 11, lock 12, unlock 11, unlock 10"},
		// The checkpoints run at once: those that succeeded are restored.
		{"checkpoint 10", "lock 10, lock 11, lock 12, checkpoint 10, checkpoint 11, checkpoint 12, restore 12, restore 11, unlock 12, unlock 11, unlock 10"},
		{"checkpoint 12", "lock 10, lock 11, lock 12, checkpoint 10, checkpoint 11, checkpoint 12, restore 11, restore 10, unlock 12, unlock 11, unlock 10"},
	}
	for _, c := range cases {
		t.Run(strings.ReplaceAll(c.fail, " ", "-"), func(t *testing.T) {
			d := newScripted(map[string]cudadriver.Result{c.fail: cudadriver.ErrorTimeout}, 10, 11, 12)
			cc := &Checkpoint{drv: d, pids: []int{10, 11, 12}}
			_, err := cc.Suspend(context.Background(), 0)
			var ce *cudadriver.Error
			if !errors.As(err, &ce) || ce.Code != cudadriver.ErrorTimeout || !strings.Contains(err.Error(), "restored and unlocked") {
				t.Fatalf("Suspend = %v, want the CUDA_ERROR_TIMEOUT of %s, undone", err, c.fail)
			}
			if got := d.log(); got != c.want {
				t.Fatalf("calls %q\nwant  %q", got, c.want)
			}
			for p, st := range d.States {
				if st != cudadriver.StateRunning {
					t.Errorf("pid %d left %s", p, st)
				}
			}
			// The stack is empty: an Undo after the failure does nothing.
			if err := cc.Undo(errors.New("again")); !strings.Contains(err.Error(), "restored and unlocked") || d.log() != c.want {
				t.Fatalf("Undo after the failed Suspend: %v, calls %q", err, d.log())
			}
		})
	}
}

// TestSuspendUndoFails: the undo goes on after a failed step (both
// unlocks are tried), and the error says what failed, the undo's failure
// and where each process is left.
func TestSuspendUndoFails(t *testing.T) {
	d := newScripted(map[string]cudadriver.Result{"checkpoint 11": cudadriver.ErrorUnknown, "restore 10": cudadriver.ErrorIllegalState}, 10, 11)
	cc := &Checkpoint{drv: d, pids: []int{10, 11}}
	_, err := cc.Suspend(context.Background(), 0)
	var stuck *StuckError
	if !errors.As(err, &stuck) {
		t.Fatalf("Suspend = %v: want a StuckError", err)
	}
	for _, s := range []string{"CUDA_ERROR_UNKNOWN", "undoing the GPU step of [10 11] failed too", "CUDA_ERROR_ILLEGAL_STATE",
		"process 10 is checkpointed: `gpucr-stream gpu restore --pid 10`", "process 11 is running"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("the error lacks %q: %v", s, err)
		}
	}
	if got, want := d.log(), "lock 10, lock 11, checkpoint 10, checkpoint 11, restore 10, unlock 11, unlock 10"; got != want {
		t.Fatalf("calls %q, want %q", got, want)
	}
}

// TestSuspendLeavesForeignStates: a process someone else locked is only
// checkpointed and stays locked after the undo; one already checkpointed
// is not touched.
func TestSuspendLeavesForeignStates(t *testing.T) {
	d := newScripted(nil, 10, 11, 12)
	d.States[11] = cudadriver.StateLocked
	d.States[12] = cudadriver.StateCheckpointed
	cc := &Checkpoint{drv: d, pids: []int{10, 11, 12}}
	if _, err := cc.Suspend(context.Background(), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := cc.Resume(); err != nil {
		t.Fatal(err)
	}
	if got, want := d.log(), "lock 10, checkpoint 10, checkpoint 11, restore 11, restore 10, unlock 10"; got != want {
		t.Fatalf("calls %q, want %q", got, want)
	}
	if d.StateOf(10) != cudadriver.StateRunning || d.StateOf(11) != cudadriver.StateLocked || d.StateOf(12) != cudadriver.StateCheckpointed {
		t.Fatalf("states %v", d.States)
	}
}

// TestLockFailedNamesOnlyWhatItLocked: the lock of the last process
// fails; the one before it was locked by someone else, so the message
// names only the process this suspend locked as unlocked at once, and
// the foreign lock stays.
func TestLockFailedNamesOnlyWhatItLocked(t *testing.T) {
	d := newScripted(map[string]cudadriver.Result{"lock 12": cudadriver.ErrorNotReady}, 10, 11, 12)
	d.States[11] = cudadriver.StateLocked
	cc := &Checkpoint{drv: d, pids: []int{10, 11, 12}}
	_, err := cc.Suspend(context.Background(), 0)
	if err == nil || !strings.Contains(err.Error(), "so process 10, locked before it, is unlocked at once") {
		t.Fatalf("err = %v, want process 10 alone named as unlocked", err)
	}
	if got, want := d.log(), "lock 10, lock 12, unlock 10"; got != want {
		t.Fatalf("calls %q, want %q", got, want)
	}
	if d.StateOf(11) != cudadriver.StateLocked {
		t.Fatalf("the foreign lock of 11: %s", d.StateOf(11))
	}
}

// TestResumeRestored: a restored tree's checkpointed processes are
// restored (at once), then unlocked; a running one is left alone; a
// refused restore leaves the process checkpointed.
func TestResumeRestored(t *testing.T) {
	d := newScripted(nil, 20, 21, 22)
	d.States[20] = cudadriver.StateCheckpointed
	d.States[21] = cudadriver.StateCheckpointed
	resumed, _, err := resumeRestored(d, []int{20, 21, 22}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := d.log(), "restore 20, restore 21, unlock 20, unlock 21"; got != want {
		t.Fatalf("calls %q, want %q", got, want)
	}
	if len(resumed) != 2 {
		t.Fatalf("resumed %v", resumed)
	}
	d = newScripted(map[string]cudadriver.Result{"restore 20": cudadriver.ErrorNotSupported}, 20)
	d.States[20] = cudadriver.StateCheckpointed
	if _, _, err := resumeRestored(d, []int{20}, []cudadriver.GPUPair{{}}); err == nil || d.StateOf(20) != cudadriver.StateCheckpointed {
		t.Fatalf("failed restore: %v, state %s", err, d.StateOf(20))
	}
}
