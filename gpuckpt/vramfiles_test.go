package gpuckpt

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/cudadriver/drivertest"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/vram"
)

// TestFastPathNotTaken: without the library in the process, with the fast
// path off, or into a destination that may not restore the VRAM files
// (tcp://), the fast path does nothing and the manifest records the
// driver's path.
func TestFastPathNotTaken(t *testing.T) {
	t.Setenv("GPUCR_PRELOAD_DIR", t.TempDir())
	pid := os.Getpid() // a process without libgpucr-preload
	archive := location.Location{Kind: location.Archive, Path: t.TempDir(), Raw: "ar"}
	tests := []struct {
		name string
		f    FastPath
		dest location.Location
	}{
		{"no library", FastPath{}, archive},
		{"off", FastPath{Mode: FastPathOff}, archive},
		{"tcp", FastPath{}, location.Location{Kind: location.TCP, Path: "h:1", Raw: "tcp://h:1"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cc := &Checkpoint{drv: drivertest.NewFake(pid), pids: []int{pid}}
			var meta manifest.Manifest
			ps, err := cc.FastSuspend(context.Background(), tc.f, FastCarried(tc.dest), nil, &meta, nil)
			if err != nil || ps != nil || cc.fast != nil {
				t.Fatalf("phases %v, err %v, fast %v: want nothing done", ps, err, cc.fast)
			}
			want := []manifest.CUDAProcess{{PID: pid, Path: manifest.CUDAPathDriver}}
			if len(meta.CUDA) != 1 || meta.CUDA[0].PID != want[0].PID || meta.CUDA[0].Path != want[0].Path || meta.CUDA[0].Files != nil {
				t.Fatalf("manifest cuda %+v, want %+v", meta.CUDA, want)
			}
		})
	}
}

// TestGPUStepFastPathRefusals: --to and --from belong to suspend and
// resume; suspend --to needs the fast path and a process with the library,
// and refuses before any driver step.
func TestGPUStepFastPathRefusals(t *testing.T) {
	t.Setenv("GPUCR_PRELOAD_DIR", t.TempDir())
	const pid = 4545
	ar := location.Location{Kind: location.Archive, Path: filepath.Join(t.TempDir(), "ar"), Raw: "ar"}
	tests := []struct {
		name  string
		o     GPUStepOptions
		usage bool
		is    error
	}{
		{"lock --to", GPUStepOptions{Action: "lock", To: ar}, true, nil},
		{"suspend --from", GPUStepOptions{Action: "suspend", From: ar}, true, nil},
		{"resume --to", GPUStepOptions{Action: "resume", To: ar}, true, nil},
		{"suspend --to, fast path off", GPUStepOptions{Action: "suspend", To: ar, FastPath: FastPath{Mode: FastPathOff}}, true, nil},
		{"suspend --to, no library", GPUStepOptions{Action: "suspend", To: ar}, false, preloadctl.ErrNotLoaded},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := drivertest.NewFake(pid)
			tc.o.PID, tc.o.FindProcs = pid, drivertest.Find(pid)
			_, err := GPUStep(context.Background(), f, tc.o)
			if err == nil || errors.Is(err, errdefs.ErrUsage) != tc.usage || (tc.is != nil && !errors.Is(err, tc.is)) {
				t.Fatalf("err %v; want usage %v, is %v", err, tc.usage, tc.is)
			}
			if log := f.Log(); log != "" {
				t.Errorf("driver steps %q before the refusal", log)
			}
			if _, serr := os.Stat(ar.Path); serr == nil {
				t.Errorf("a refused suspend --to left %s", ar.Path)
			}
		})
	}
}

// listSource is a stream source that only lists files.
type listSource struct {
	source.Source
	files []manifest.File
}

func (s listSource) Files(context.Context) ([]manifest.File, error) { return s.files, nil }

// TestFastProcsFromStream: a stream (the copy migrate keeps) carries no
// manifest a restore reads; its fast-path processes are those whose VRAM
// files it holds, by name, flagged external. Anything else is not one.
func TestFastProcsFromStream(t *testing.T) {
	ext := func(name string, size int64) manifest.File {
		return manifest.File{Name: name, Size: size, External: true}
	}
	tests := []struct {
		name  string
		files []manifest.File
		want  []manifest.CUDAProcess
	}{
		{"none", []manifest.File{{Name: "pages-1.img"}, {Name: "inventory.img"}}, nil},
		{"two processes", []manifest.File{ext("vram-12-00.bin", 5), ext("vram-12-01.bin", 7), {Name: "pages-1.img"}, ext("vram-9-00.bin", 3)},
			[]manifest.CUDAProcess{{PID: 12, Path: manifest.CUDAPathPreload, Files: []string{"vram-12-00.bin", "vram-12-01.bin"}, Bytes: 12},
				{PID: 9, Path: manifest.CUDAPathPreload, Files: []string{"vram-9-00.bin"}, Bytes: 3}}},
		{"not external", []manifest.File{{Name: "vram-12-00.bin", Size: 5}}, nil},
		{"not the pattern", []manifest.File{ext("vram-12-0.bin", 1), ext("vram-12-000.bin", 1), ext("vram--00.bin", 1), ext("vram-0-00.bin", 1),
			ext("vram-+1-00.bin", 1), ext("vram-12-00.img", 1), ext("12-00.bin", 1), ext("vram-12-00.bin.x", 1), ext("vram-1x-00.bin", 1)}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := FastProcs(context.Background(), listSource{files: tc.files})
			if err != nil || !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("FastProcs = %+v, %v; want %+v", got, err, tc.want)
			}
		})
	}
}

// TestFastCarried: the destinations whose restore brings the VRAM files
// back take the fast path; gpu suspend --to needs an archive, which gpu
// resume --from reads.
func TestFastCarried(t *testing.T) {
	for _, tc := range []struct {
		kind              location.Kind
		carried, archived bool
	}{
		{location.Archive, true, true},
		{location.S3, true, true},
		{location.Stdio, true, false},
		{location.StreamFile, true, false},
		{location.TCP, false, false},
	} {
		l := location.Location{Kind: tc.kind}
		if FastCarried(l) != tc.carried || archived(l) != tc.archived {
			t.Errorf("kind %d: carried %v, archived %v; want %v, %v", tc.kind, FastCarried(l), archived(l), tc.carried, tc.archived)
		}
	}
}

// TestFastRestoreOnlyRestored: a fast-path record naming a process that is
// not one of the restored CUDA processes is refused before anything
// reaches that process's library.
func TestFastRestoreOnlyRestored(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("GPUCR_PRELOAD_DIR", dir)
	procs := []manifest.CUDAProcess{{PID: 4242, Path: manifest.CUDAPathPreload, Files: []string{"vram-4242-00.bin"}}}
	_, err := FastRestore(context.Background(), listSource{}, nil, nil, procs, []int{4343})
	if err == nil || !strings.Contains(err.Error(), "not one of the restored CUDA processes") {
		t.Fatalf("FastRestore of another process: %v", err)
	}
	if errors.Is(err, preloadctl.ErrNotLoaded) {
		t.Fatalf("FastRestore dialled process 4242: %v", err)
	}
}

// TestRestoredPID: a fast-path record finds its restored process by the
// PID it had in its own namespace where it had one (a container's init,
// which runc restore gives a new PID on the host, while another restored
// process may now hold its old one), else by its PID; never a process
// that is not among the restored, nor one of two that both match.
func TestRestoredPID(t *testing.T) {
	ns := map[int]int{101: 1, 102: 2, 200: 200, 300: 7, 301: 7}
	nsPID := func(pid int) int { return ns[pid] }
	for _, tc := range []struct {
		name string
		rec  manifest.CUDAProcess
		pids []int
		want int
	}{
		{"same PID, no namespace", manifest.CUDAProcess{PID: 200}, []int{200}, 200},
		{"gone, no namespace", manifest.CUDAProcess{PID: 200}, []int{201}, 0},
		{"a container's init, new host PID", manifest.CUDAProcess{PID: 100, NSPID: 1}, []int{101, 102}, 101},
		{"its old PID now another's", manifest.CUDAProcess{PID: 101, NSPID: 2}, []int{101, 102}, 102},
		{"no restored process has its namespace PID", manifest.CUDAProcess{PID: 101, NSPID: 3}, []int{101, 102}, 0},
		{"two have it, one its PID too (sibling namespaces, plain CRIU)", manifest.CUDAProcess{PID: 300, NSPID: 7}, []int{300, 301}, 300},
		{"two have it, neither its PID", manifest.CUDAProcess{PID: 299, NSPID: 7}, []int{300, 301}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := restoredPID(tc.rec, tc.pids, nsPID); got != tc.want {
				t.Fatalf("restoredPID(%+v, %v) = %d, want %d", tc.rec, tc.pids, got, tc.want)
			}
		})
	}
}

// TestPerProcess: a tree of several processes gets one copy phase each,
// naming its GPU where the checkpoint recorded it; one process gets none
// (the copy's own phases say it all).
func TestPerProcess(t *testing.T) {
	cs := func(gib float64, secs float64) preloadctl.CopyStats {
		return preloadctl.CopyStats{Bytes: int64(gib * (1 << 30)), Work: time.Duration(secs * float64(time.Second))}
	}
	for _, tc := range []struct {
		name  string
		procs []vram.FastProc
		gpus  []manifest.GPU
		want  []Phase
	}{
		{"one process", []vram.FastProc{{PID: 1, Copy: cs(6, 0.4)}}, nil, nil},
		{"a pair", []vram.FastProc{{PID: 1, Copy: cs(6, 0.4)}, {PID: 2, Copy: cs(2, 0.25)}},
			[]manifest.GPU{{PID: 1, UUID: "GPU-a"}, {PID: 2, UUID: "GPU-b"}, {PID: 3, UUID: "GPU-c"}},
			[]Phase{{"vram copy out: process 1 on GPU-a (6.00 GiB)", 0.4}, {"vram copy out: process 2 on GPU-b (2.00 GiB)", 0.25}}},
		{"no GPUs recorded", []vram.FastProc{{PID: 1, Copy: cs(1, 0.1)}, {PID: 2, Copy: cs(1, 0.1)}}, nil,
			[]Phase{{"vram copy out: process 1 (1.00 GiB)", 0.1}, {"vram copy out: process 2 (1.00 GiB)", 0.1}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := perProcess("copy out", tc.procs, tc.gpus); !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("perProcess = %+v, want %+v", got, tc.want)
			}
		})
	}
}
