// Package vramtest has a fake CUDA driver for tests of the checkpoint
// policy: it keeps each process's state, logs every call, and fails the
// steps it is told to.
package vramtest

import (
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/vram"
)

// Fake is a vram.Driver whose processes move through the driver's states
// as the real one's do.
type Fake struct {
	mu     sync.Mutex
	States map[int]vram.State
	calls  []string
	// FailOn names the steps (lock, checkpoint, restore, unlock) that fail.
	FailOn map[string]bool
}

// NewFake returns a driver that sees pid running on the GPU.
func NewFake(pid int) *Fake {
	return &Fake{States: map[int]vram.State{pid: vram.StateRunning}, FailOn: map[string]bool{}}
}

func (f *Fake) step(op string, pid int, from, to vram.State) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, fmt.Sprintf("%s %d", op, pid))
	if f.FailOn[op] {
		return &vram.Error{Op: op, PID: pid, Code: vram.ErrorUnknown}
	}
	if f.States[pid] != from {
		return &vram.Error{Op: op, PID: pid, Code: vram.ErrorIllegalState}
	}
	f.States[pid] = to
	return nil
}

// Version implements vram.Driver.
func (f *Fake) Version() (int, error) { return 13000, nil }

// StateOf is pid's state now.
func (f *Fake) StateOf(pid int) vram.State {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.States[pid]
}

// State implements vram.Driver.
func (f *Fake) State(pid int) (vram.State, error) { return f.StateOf(pid), nil }

// Lock implements vram.Driver.
func (f *Fake) Lock(pid int, _ time.Duration) error {
	return f.step("lock", pid, vram.StateRunning, vram.StateLocked)
}

// Checkpoint implements vram.Driver.
func (f *Fake) Checkpoint(pid int) error {
	return f.step("checkpoint", pid, vram.StateLocked, vram.StateCheckpointed)
}

// Restore implements vram.Driver.
func (f *Fake) Restore(pid int, _ []vram.GPUPair) error {
	return f.step("restore", pid, vram.StateCheckpointed, vram.StateLocked)
}

// Unlock implements vram.Driver.
func (f *Fake) Unlock(pid int) error {
	return f.step("unlock", pid, vram.StateLocked, vram.StateRunning)
}

// Log is the calls so far: "lock 42, checkpoint 42".
func (f *Fake) Log() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return strings.Join(f.calls, ", ")
}

// Find is a vram.FindCUDA that sees pid, with the GPU open, in every tree.
func Find(pid int) func(root int) ([]vram.Usage, []int, error) {
	return func(root int) ([]vram.Usage, []int, error) {
		return []vram.Usage{{PID: pid, MapsLibcuda: true, DeviceFDs: 2}}, []int{root}, nil
	}
}
