package cudadriver

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// fakeDriver records every call and fails the ones it is told to.
type fakeDriver struct {
	mu     sync.Mutex
	calls  []string
	state  map[int]State
	failOn map[string]Result // "lock 2", "checkpoint 3", ...
}

func newFake(pids ...int) *fakeDriver {
	f := &fakeDriver{state: map[int]State{}, failOn: map[string]Result{}}
	for _, p := range pids {
		f.state[p] = StateRunning
	}
	return f
}

func (f *fakeDriver) step(op string, pid int, from, to State) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	key := fmt.Sprintf("%s %d", op, pid)
	f.calls = append(f.calls, key)
	if r, ok := f.failOn[key]; ok {
		return &Error{Op: op, PID: pid, Code: r}
	}
	if f.state[pid] != from {
		return &Error{Op: op, PID: pid, Code: ErrorIllegalState}
	}
	f.state[pid] = to
	return nil
}

func (f *fakeDriver) Version() (int, error) { return 13000, nil }

func (f *fakeDriver) State(pid int) (State, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, ok := f.state[pid]
	if !ok {
		return StateFailed, &Error{Op: "get state", PID: pid, Code: ErrorInvalidValue}
	}
	return st, nil
}

func (f *fakeDriver) Lock(pid int, timeout time.Duration) error {
	return f.step("lock", pid, StateRunning, StateLocked)
}
func (f *fakeDriver) Checkpoint(pid int) error {
	return f.step("checkpoint", pid, StateLocked, StateCheckpointed)
}
func (f *fakeDriver) Restore(pid int, pairs []GPUPair) error {
	return f.step("restore", pid, StateCheckpointed, StateLocked)
}
func (f *fakeDriver) Unlock(pid int) error {
	return f.step("unlock", pid, StateLocked, StateRunning)
}

// log lists the calls in order; a run of calls of one step that ran at
// once (checkpoints in Suspend, restores in ResumeRestored) in the order of
// their pids.
func (f *fakeDriver) log() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return strings.Join(atOnce(f.calls), ", ")
}

func atOnce(calls []string) []string {
	out := slices.Clone(calls)
	for i := 0; i < len(out); {
		j := i + 1
		verb := strings.Fields(out[i])[0]
		for j < len(out) && strings.Fields(out[j])[0] == verb {
			j++
		}
		if verb == "checkpoint" || (verb == "restore" && i == 0) {
			slices.SortFunc(out[i:j], func(a, b string) int {
				x, _ := strconv.Atoi(strings.Fields(a)[1])
				y, _ := strconv.Atoi(strings.Fields(b)[1])
				return x - y
			})
		}
		i = j
	}
	return out
}
