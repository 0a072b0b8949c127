package gpuckpt

import (
	"context"
	"errors"
	"os"
	"testing"

	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/cudadriver/drivertest"
	"github.com/gpucr/gpucr-stream/errdefs"
)

// TestDriverRoom: a driver's checkpoint whose copy of the device memory
// does not fit in the host's memory is refused before the GPU is locked
// (an H200's inference server was OOM-killed in the middle of one).
func TestDriverRoom(t *testing.T) {
	pid := os.Getpid()
	for _, tc := range []struct {
		name   string
		gpus   []cudadriver.GPUInfo
		refuse bool
	}{
		{"fits", []cudadriver.GPUInfo{{UUID: "GPU-a", PID: pid, Bytes: 1 << 20}}, false},
		{"more than the host has", []cudadriver.GPUInfo{{UUID: "GPU-a", PID: pid, Bytes: 1 << 50}}, true},
		{"summed over GPUs", []cudadriver.GPUInfo{{UUID: "GPU-a", PID: pid, Bytes: 1 << 49}, {UUID: "GPU-b", PID: pid, Bytes: 1 << 49}}, true},
		{"nvidia-smi could not tell", []cudadriver.GPUInfo{{UUID: "GPU-a"}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := drivertest.NewFake(pid)
			q := make(chan struct{})
			close(q)
			cc := &Checkpoint{drv: f, pids: []int{pid}, query: q, gpus: tc.gpus}
			_, err := cc.Suspend(context.Background(), 0)
			if got := errors.Is(err, errdefs.ErrNoRoom); got != tc.refuse {
				t.Fatalf("Suspend: %v, want a refusal: %v", err, tc.refuse)
			}
			if tc.refuse && f.StateOf(pid) != cudadriver.StateRunning {
				t.Fatalf("refused, but the process is %v", f.StateOf(pid))
			}
			if !tc.refuse && err != nil {
				t.Fatalf("Suspend: %v", err)
			}
		})
	}
}
