//go:build gpucr_testhooks

package gpuckpt

import (
	"context"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/cudadriver"
)

// TestFaultLocksAndUndoes: the GPU machine's ncclfault round
// (GPUCR_TEST_FAULT=gpu-checkpoint) lets an NCCL tree through to the lock,
// fails the checkpoint step before the driver sees it, and has the tree
// unlocked at once.
func TestFaultLocksAndUndoes(t *testing.T) {
	t.Setenv("GPUCR_TEST_FAULT", "gpu-checkpoint")
	lo := [2]string{lo40000, lo40001}
	fakeProcRoot(t, map[int]fakeProc{
		11: {maps: []string{libcuda, libnccl}, tcp: [][2]string{lo}},
		12: {maps: []string{libcuda, libnccl}, tcp: [][2]string{{lo[1], lo[0]}}}})
	d := newScripted(nil, 11, 12)
	find := func(root int) ([]cudadriver.Usage, []int, error) {
		return []cudadriver.Usage{{PID: 11, DeviceFDs: 2}, {PID: 12, DeviceFDs: 2}}, []int{11, 12}, nil
	}
	_, err := GPUStep(context.Background(), d, GPUStepOptions{Action: "suspend", PID: 11, FindProcs: find})
	if err == nil || !strings.Contains(err.Error(), "injected gpu-checkpoint failure") || !strings.Contains(err.Error(), "runs on") {
		t.Fatalf("err = %v", err)
	}
	if got, want := d.log(), "lock 11, lock 12, unlock 12, unlock 11"; got != want {
		t.Fatalf("driver calls %q, want %q", got, want)
	}
	for _, pid := range []int{11, 12} {
		if st := d.StateOf(pid); st != cudadriver.StateRunning {
			t.Errorf("process %d is %s", pid, st)
		}
	}
}
