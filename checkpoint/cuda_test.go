package checkpoint

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/capture"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/vram"
	"github.com/gpucr/gpucr-stream/vram/vramtest"
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
			f := vramtest.NewFake(pid)
			// As CRIU restores it: device memory still in host memory.
			f.States[pid] = vram.StateCheckpointed
			if c.failOn != "" {
				f.FailOn[c.failOn] = true
			}
			cuda := CUDA{Mode: CUDAMode(c.cuda), OpenDriver: func() (vram.Driver, error) { return f, nil }, FindProcs: vramtest.Find(pid)}
			rep := capture.RestoreReport{PID: pid}
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
				if c.cuda != "off" && (len(cudaPIDs) != 1 || len(TimingPhases(tm)) == 0) {
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

// TestGPUMapAll: all=NEW resolves against the one GPU a checkpoint
// records, and is a usage error for any other number.
func TestGPUMapAll(t *testing.T) {
	const u = "GPU-b9866d0b-7eb7-389c-2420-04c59d30be30"
	to, err := vram.ParseUUID(u)
	if err != nil {
		t.Fatal(err)
	}
	m := GPUMap{All: true, AllTo: to}
	old := manifest.GPU{UUID: "GPU-00000000-0000-0000-0000-000000000001", PID: 1}
	tests := []struct {
		name string
		gpus []manifest.GPU
		ok   bool
	}{
		{"one", []manifest.GPU{old}, true},
		{"one-twice", []manifest.GPU{old, old}, true},
		{"none", nil, false},
		{"two", []manifest.GPU{old, {UUID: u}}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pairs, err := m.For(tc.gpus)
			if !tc.ok {
				if !errors.Is(err, errdefs.ErrUsage) {
					t.Fatalf("For(%v) = %v, %v; want a usage error", tc.gpus, pairs, err)
				}
				return
			}
			if err != nil || len(pairs) != 1 || pairs[0].Old[15] != 1 || pairs[0].New != to {
				t.Fatalf("For(%v) = %v, %v", tc.gpus, pairs, err)
			}
		})
	}
}

// TestGPUStep: the single driver steps and the tree's suspend and resume
// drive the driver as cuda-checkpoint would; an unknown action is a usage
// error.
func TestGPUStep(t *testing.T) {
	const pid = 4343
	f := vramtest.NewFake(pid)
	steps := []struct {
		action, calls, state string
	}{
		{"state", "", "running"},
		{"suspend", "lock P, checkpoint P", ""},
		{"resume", "lock P, checkpoint P, restore P, unlock P", ""},
		{"lock", "lock P, checkpoint P, restore P, unlock P, lock P", ""},
		{"unlock", "lock P, checkpoint P, restore P, unlock P, lock P, unlock P", ""},
	}
	for _, s := range steps {
		res, err := GPUStep(context.Background(), f, GPUStepOptions{Action: s.action, PID: pid, FindProcs: vramtest.Find(pid)})
		if err != nil {
			t.Fatalf("%s: %v", s.action, err)
		}
		if got, want := f.Log(), strings.ReplaceAll(s.calls, "P", strconv.Itoa(pid)); got != want {
			t.Fatalf("%s: driver calls %q, want %q", s.action, got, want)
		}
		if res.State != s.state {
			t.Errorf("%s: state %q, want %q", s.action, res.State, s.state)
		}
	}
	if _, err := GPUStep(context.Background(), f, GPUStepOptions{Action: "frob", PID: pid}); !errors.Is(err, errdefs.ErrUsage) {
		t.Fatalf("unknown action: %v", err)
	}
}
