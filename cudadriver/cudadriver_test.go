package cudadriver

import (
	"errors"
	"strings"
	"testing"
)

func TestOpenDefaultWithoutDriver(t *testing.T) {
	// On CI hosts without a GPU, Open must fail plainly (and never panic);
	// on a GPU host it must succeed.
	d, err := Open()
	if err != nil {
		if !errors.Is(err, ErrNoDriver) && !errors.Is(err, ErrUnsupported) {
			t.Fatalf("Open() = %v: want ErrNoDriver or ErrUnsupported", err)
		}
		t.Logf("no driver here: %v", err)
		return
	}
	v, _ := d.Version()
	t.Logf("driver CUDA %s", VersionString(v))
}

func TestNames(t *testing.T) {
	for s, want := range map[State]string{StateRunning: "running", StateLocked: "locked", StateCheckpointed: "checkpointed", StateFailed: "failed", 7: "state(7)"} {
		if s.String() != want {
			t.Errorf("State(%d) = %q, want %q", int(s), s, want)
		}
	}
	for r, want := range map[Result]string{Success: "CUDA_SUCCESS", ErrorTimeout: "CUDA_ERROR_TIMEOUT", ErrorNotSupported: "CUDA_ERROR_NOT_SUPPORTED", ErrorIllegalState: "CUDA_ERROR_ILLEGAL_STATE", 12345: "CUresult(12345)"} {
		if r.String() != want {
			t.Errorf("Result(%d) = %q, want %q", int(r), r, want)
		}
	}
	e := &Error{Op: "lock", PID: 42, Code: ErrorTimeout}
	if !strings.Contains(e.Error(), "cuda lock of pid 42: CUDA_ERROR_TIMEOUT") || !strings.Contains(e.Error(), "--lock-timeout") {
		t.Errorf("lock timeout error %q", e)
	}
}

func TestUUID(t *testing.T) {
	const s = "GPU-b9866d0b-7eb7-389c-2420-04c59d30be30"
	u, err := ParseUUID(s)
	if err != nil {
		t.Fatal(err)
	}
	if u.String() != s {
		t.Fatalf("round trip %q -> %q", s, u)
	}
	if u2, err := ParseUUID("B9866D0B7EB7389C242004C59D30BE30"); err != nil || u2 != u {
		t.Fatalf("bare hex: %v %v", u2, err)
	}
	for _, bad := range []string{"", "GPU-", "GPU-b9866d0b", "GPU-b9866d0b-7eb7-389c-2420-04c59d30be3g", "GPU-b9866d0b-7eb7-389c-2420-04c59d30be3000"} {
		if _, err := ParseUUID(bad); err == nil {
			t.Errorf("ParseUUID(%q) accepted", bad)
		}
	}
	pairs, err := ParseGPUMap(s + "=GPU-00000000-0000-0000-0000-000000000001," + s + "=" + s)
	if err != nil || len(pairs) != 2 || pairs[0].Old != u || pairs[0].New[15] != 1 || pairs[1].New != u {
		t.Fatalf("ParseGPUMap: %v %v", pairs, err)
	}
	if back, err := ParseGPUMap(FormatGPUMap(pairs)); err != nil || len(back) != 2 || back[0] != pairs[0] || back[1] != pairs[1] {
		t.Fatalf("ParseGPUMap(FormatGPUMap(%v)) = %v %v", pairs, back, err)
	}
	if _, err := ParseGPUMap(s); err == nil {
		t.Error("ParseGPUMap without '=' accepted")
	}
}

func TestSuspendResume(t *testing.T) {
	f := newFake(10, 11)
	s, err := Suspend(f, []int{10, 11}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := f.log(), "lock 10, lock 11, checkpoint 10, checkpoint 11"; got != want {
		t.Fatalf("calls %q, want %q", got, want)
	}
	if err := s.Resume(nil); err != nil {
		t.Fatal(err)
	}
	if got, want := f.log(), "lock 10, lock 11, checkpoint 10, checkpoint 11, restore 11, restore 10, unlock 11, unlock 10"; got != want {
		t.Fatalf("calls %q, want %q", got, want)
	}
	if err := s.Resume(nil); err != nil || strings.Count(f.log(), "restore") != 2 {
		t.Fatalf("second Resume did something: %v, %s", err, f.log())
	}
	for _, p := range []int{10, 11} {
		if f.state[p] != StateRunning {
			t.Errorf("pid %d left %s", p, f.state[p])
		}
	}
}

// Undo paths: whatever step fails, every process ends running, with
// restores before unlocks, each in reverse order.
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
			f := newFake(10, 11, 12)
			f.failOn[c.fail] = ErrorTimeout
			_, err := Suspend(f, []int{10, 11, 12}, 0)
			var ce *Error
			if !errors.As(err, &ce) || ce.Code != ErrorTimeout {
				t.Fatalf("Suspend = %v, want the CUDA_ERROR_TIMEOUT of %s", err, c.fail)
			}
			if got := f.log(); got != c.want {
				t.Fatalf("calls %q\nwant  %q", got, c.want)
			}
			for p, st := range f.state {
				if st != StateRunning {
					t.Errorf("pid %d left %s", p, st)
				}
			}
		})
	}
}

func TestSuspendUndoFails(t *testing.T) {
	f := newFake(10, 11)
	f.failOn["checkpoint 11"] = ErrorUnknown
	f.failOn["restore 10"] = ErrorIllegalState
	_, err := Suspend(f, []int{10, 11}, 0)
	if err == nil || !strings.Contains(err.Error(), "undo failed") || !strings.Contains(err.Error(), "CUDA_ERROR_UNKNOWN") {
		t.Fatalf("Suspend = %v: want the cause and the undo failure", err)
	}
	// The undo goes on after a failed step: both unlocks were tried.
	if got, want := f.log(), "lock 10, lock 11, checkpoint 10, checkpoint 11, restore 10, unlock 11, unlock 10"; got != want {
		t.Fatalf("calls %q, want %q", got, want)
	}
}

func TestSuspendLeavesForeignStates(t *testing.T) {
	// A process someone else locked is only checkpointed and stays locked
	// after the undo; one already checkpointed is not touched.
	f := newFake(10, 11, 12)
	f.state[11] = StateLocked
	f.state[12] = StateCheckpointed
	s, err := Suspend(f, []int{10, 11, 12}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Resume(nil); err != nil {
		t.Fatal(err)
	}
	if got, want := f.log(), "lock 10, checkpoint 10, checkpoint 11, restore 11, restore 10, unlock 10"; got != want {
		t.Fatalf("calls %q, want %q", got, want)
	}
	if f.state[10] != StateRunning || f.state[11] != StateLocked || f.state[12] != StateCheckpointed {
		t.Fatalf("states %v", f.state)
	}
}

func TestResumeRestored(t *testing.T) {
	f := newFake(20, 21, 22)
	f.state[20] = StateCheckpointed
	f.state[21] = StateCheckpointed
	resumed, _, err := ResumeRestored(f, []int{20, 21, 22}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := f.log(), "restore 20, restore 21, unlock 20, unlock 21"; got != want {
		t.Fatalf("calls %q, want %q", got, want)
	}
	if len(resumed) != 2 {
		t.Fatalf("resumed %v", resumed)
	}
	f = newFake(20)
	f.state[20] = StateCheckpointed
	f.failOn["restore 20"] = ErrorNotSupported
	if _, _, err := ResumeRestored(f, []int{20}, []GPUPair{{}}); err == nil || f.state[20] != StateCheckpointed {
		t.Fatalf("failed restore: %v, state %s", err, f.state[20])
	}
}
