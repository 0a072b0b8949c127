// Package drivertest has a fake CUDA driver for tests of the checkpoint
// policy: it keeps each process's state, logs every call, and fails the
// steps it is told to.
package drivertest

import (
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/cudadriver"
)

// Fake is a cudadriver.Driver whose processes move through the driver's states
// as the real one's do.
type Fake struct {
	mu     sync.Mutex
	States map[int]cudadriver.State
	calls  []string
	// FailOn names the steps (lock, checkpoint, restore, unlock) that fail.
	FailOn map[string]bool
}

// NewFake returns a driver that sees pid running on the GPU.
func NewFake(pid int) *Fake {
	return &Fake{States: map[int]cudadriver.State{pid: cudadriver.StateRunning}, FailOn: map[string]bool{}}
}

func (f *Fake) step(op string, pid int, from, to cudadriver.State) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, fmt.Sprintf("%s %d", op, pid))
	if f.FailOn[op] {
		return &cudadriver.Error{Op: op, PID: pid, Code: cudadriver.ErrorUnknown}
	}
	if f.States[pid] != from {
		return &cudadriver.Error{Op: op, PID: pid, Code: cudadriver.ErrorIllegalState}
	}
	f.States[pid] = to
	return nil
}

// Version implements cudadriver.Driver.
func (f *Fake) Version() (int, error) { return 13000, nil }

// StateOf is pid's state now.
func (f *Fake) StateOf(pid int) cudadriver.State {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.States[pid]
}

// State implements cudadriver.Driver.
func (f *Fake) State(pid int) (cudadriver.State, error) { return f.StateOf(pid), nil }

// Lock implements cudadriver.Driver.
func (f *Fake) Lock(pid int, _ time.Duration) error {
	return f.step("lock", pid, cudadriver.StateRunning, cudadriver.StateLocked)
}

// Checkpoint implements cudadriver.Driver.
func (f *Fake) Checkpoint(pid int) error {
	return f.step("checkpoint", pid, cudadriver.StateLocked, cudadriver.StateCheckpointed)
}

// Restore implements cudadriver.Driver.
func (f *Fake) Restore(pid int, _ []cudadriver.GPUPair) error {
	return f.step("restore", pid, cudadriver.StateCheckpointed, cudadriver.StateLocked)
}

// Unlock implements cudadriver.Driver.
func (f *Fake) Unlock(pid int) error {
	return f.step("unlock", pid, cudadriver.StateLocked, cudadriver.StateRunning)
}

// Log is the calls so far: "lock 42, checkpoint 42".
func (f *Fake) Log() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return strings.Join(f.calls, ", ")
}

// Find is a cudadriver.FindCUDA that sees pid, with the GPU open, in every tree.
func Find(pid int) func(root int) ([]cudadriver.Usage, []int, error) {
	return func(root int) ([]cudadriver.Usage, []int, error) {
		return []cudadriver.Usage{{PID: pid, MapsLibcuda: true, DeviceFDs: 2}}, []int{root}, nil
	}
}
