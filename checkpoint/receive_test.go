package checkpoint

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/cudadriver/drivertest"
	"github.com/gpucr/gpucr-stream/gpuckpt"
)

// TestFinishRestore: receive --restore reports the restored PID to the
// sender only when CRIU and the GPU restore both succeeded; otherwise it
// reports the error, and the sender keeps its copy.
func TestFinishRestore(t *testing.T) {
	const pid = 4242
	cases := []struct {
		name, failOn, cuda string
		criuErr            error
		calls              string
		wantErr            string
	}{
		{"restored", "", "auto", nil, "restore P, unlock P", ""},
		{"gpu-restore-fails", "restore", "auto", nil, "restore P", "process {pid} restored, but its GPU state is not"},
		{"gpu-unlock-fails", "unlock", "auto", nil, "restore P, unlock P", "process {pid} restored, but its GPU state is not"},
		{"criu-fails", "", "auto", errors.New("restore: criu restore: exit status 1"), "", "criu restore"},
		{"cuda-off", "", "off", nil, "", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := drivertest.NewFake(pid)
			// As CRIU restores it: device memory still in host memory.
			f.States[pid] = cudadriver.StateCheckpointed
			if c.failOn != "" {
				f.FailOn[c.failOn] = true
			}
			cuda := gpuckpt.CUDA{Mode: gpuckpt.CUDAMode(c.cuda), OpenDriver: func() (cudadriver.Driver, error) { return f, nil }, FindProcs: drivertest.Find(pid)}
			rep := criusock.RestoreReport{PID: pid}
			rep.Served = 7
			report, cudaPIDs, tm, err := finishRestore(context.Background(), cuda, rep, c.criuErr, nil)
			p := strconv.Itoa(pid)
			if got, want := f.Log(), strings.ReplaceAll(c.calls, "P", p); got != want {
				t.Errorf("driver calls %q, want %q", got, want)
			}
			if report.Served != 7 {
				t.Errorf("report %+v lost the served count", report)
			}
			if c.wantErr == "" {
				if err != nil || report.Error != "" || report.PID != pid {
					t.Fatalf("report %+v, err %v; want pid %d", report, err, pid)
				}
				if c.cuda != "off" && (len(cudaPIDs) != 1 || len(gpuckpt.TimingPhases(tm)) == 0) {
					t.Errorf("cuda pids %v, timings %+v", cudaPIDs, tm)
				}
				return
			}
			want := strings.ReplaceAll(c.wantErr, "{pid}", p)
			if err == nil || !strings.Contains(err.Error(), want) {
				t.Fatalf("err %v, want %q", err, want)
			}
			if report.PID != 0 || report.Error != err.Error() {
				t.Fatalf("report %+v for %v: the sender must hear the error and no pid", report, err)
			}
		})
	}
}
