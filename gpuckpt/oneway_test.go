package gpuckpt

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/cudadriver/drivertest"
	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/proc"
)

// fakeProc is one process of a fake /proc tree.
type fakeProc struct {
	maps    []string // mapped files
	threads []string
	unix    []string    // bound names of its unix sockets
	tcp     [][2]string // established: local, remote (kernel hex form)
}

// fakeProcRoot points proc.Root at a /proc holding procs, for the test.
func fakeProcRoot(t *testing.T, procs map[int]fakeProc) {
	t.Helper()
	root := t.TempDir()
	old := proc.Root
	proc.Root = root
	t.Cleanup(func() { proc.Root = old })
	ino := 1000
	// One network namespace: every process's net/tcp lists all of its
	// connections, as the kernel's does.
	var tcp strings.Builder
	tcp.WriteString("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n")
	for pid, p := range procs {
		dir := filepath.Join(root, strconv.Itoa(pid))
		for _, d := range []string{"fd", "net", "ns", "task/1"} {
			if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		var maps strings.Builder
		for i, m := range p.maps {
			fmt.Fprintf(&maps, "7f%04x000-7f%04x000 r-xp 00000000 08:01 %d                    %s\n", i, i+1, 100+i, m)
		}
		var unix strings.Builder
		unix.WriteString("Num       RefCount Protocol Flags    Type St Inode Path\n")
		fd := 3
		link := func() int {
			ino++
			fd++
			if err := os.Symlink(fmt.Sprintf("socket:[%d]", ino), filepath.Join(dir, "fd", strconv.Itoa(fd))); err != nil {
				t.Fatal(err)
			}
			return ino
		}
		for _, u := range p.unix {
			fmt.Fprintf(&unix, "0000000000000000: 00000002 00000000 00010000 0001 01 %d %s\n", link(), u)
		}
		for i, c := range p.tcp {
			fmt.Fprintf(&tcp, "%4d: %s %s 01 00000000:00000000 00:00000000 00000000     0        0 %d 1 0000000000000000 20 4 30 10 -1\n", i, c[0], c[1], link())
		}
		threads := p.threads
		if len(threads) == 0 {
			threads = []string{"python3"}
		}
		for i, n := range threads {
			td := filepath.Join(dir, "task", strconv.Itoa(i+1))
			if err := os.MkdirAll(td, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(td, "comm"), []byte(n+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		for name, body := range map[string]string{"maps": maps.String(), "net/unix": unix.String(), "net/tcp6": ""} {
			if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Symlink("net:[4026531840]", filepath.Join(dir, "ns", "net")); err != nil {
			t.Fatal(err)
		}
	}
	for pid := range procs {
		if err := os.WriteFile(filepath.Join(root, strconv.Itoa(pid), "net", "tcp"), []byte(tcp.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// fakePreload answers `report` on pid's control socket in a fresh
// GPUCR_PRELOAD_DIR as the library would.
func fakePreload(t *testing.T, pid int, rep preloadctl.Report) {
	t.Helper()
	dir := t.TempDir()
	t.Setenv("GPUCR_PRELOAD_DIR", dir)
	ln, err := net.Listen("unix", preloadctl.Socket(dir, pid))
	if err != nil {
		t.Fatal(err)
	}
	js, _ := json.Marshal(rep)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			rd := bufio.NewReader(c)
			for {
				line, err := rd.ReadString('\n')
				if err != nil {
					break
				}
				if strings.TrimSpace(line) == "report" {
					fmt.Fprintf(c, "ok %s\n", js)
				} else {
					fmt.Fprintf(c, "err unknown command\n")
				}
			}
			c.Close()
		}
	}()
	t.Cleanup(func() { ln.Close(); <-done })
}

const (
	libcuda = "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05"
	libnccl = "/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"
	preload = "/usr/local/lib/gpucr-stream/libgpucr-preload.so"
	// 127.0.0.1:40000 <-> 127.0.0.1:40001, as /proc/net/tcp writes them
	lo40000 = "0100007F:9C40"
	lo40001 = "0100007F:9C41"
)

// TestCheckUndoable: the processes whose GPU step the driver could not
// undo are told from /proc and from the preload library's report, and
// refused with what shows it; libnccl alone (every PyTorch process maps
// it) and memory the library can only not recreate are not refused.
func TestCheckUndoable(t *testing.T) {
	for _, tc := range []struct {
		name    string
		procs   map[int]fakeProc
		report  *preloadctl.Report // for pid 11, which then maps the library
		refused []string           // in the error; none: not refused
	}{
		{"nccl shm segment", map[int]fakeProc{11: {maps: []string{libcuda, libnccl, "/dev/shm/nccl-Ab12Cd (deleted)"}}},
			nil, []string{"process 11 is an NCCL rank", "maps libnccl.so.2", "/dev/shm/nccl-Ab12Cd", "CUDA_ERROR_NOT_SUPPORTED", "runs on", "`gpucr-stream run`"}},
		{"nccl ipc socket", map[int]fakeProc{11: {maps: []string{libcuda, libnccl}, unix: []string{"@/tmp/nccl-socket-0-5e1f2a"}}},
			nil, []string{"process 11 is an NCCL rank", "@/tmp/nccl-socket-0-5e1f2a"}},
		{"nccl thread", map[int]fakeProc{11: {maps: []string{libcuda, libnccl}, threads: []string{"python3", "NCCL Service  0"}}},
			nil, []string{"process 11 is an NCCL rank", `"NCCL Service  0"`}},
		{"nccl pair over loopback", map[int]fakeProc{
			11: {maps: []string{libcuda, libnccl}, tcp: [][2]string{{lo40000, lo40001}}},
			12: {maps: []string{libcuda, libnccl}, tcp: [][2]string{{lo40001, lo40000}}}},
			nil, []string{"process 11 is an NCCL rank", "connected over TCP to process 12", "process 12 is an NCCL rank", "to process 11"}},
		{"libnccl alone", map[int]fakeProc{11: {maps: []string{libcuda, libnccl}, unix: []string{"@/tmp/other"}}}, nil, nil},
		{"loopback without nccl", map[int]fakeProc{
			11: {maps: []string{libcuda}, tcp: [][2]string{{lo40000, lo40001}}},
			12: {maps: []string{libcuda, libnccl}, tcp: [][2]string{{lo40001, lo40000}}}}, nil, nil},
		{"preload: IPC export", map[int]fakeProc{11: {maps: []string{libcuda}}},
			&preloadctl.Report{PID: 11, Reason: "the program called cuIpcGetMemHandle"},
			[]string{"process 11 shares device memory with another process", "the preload library saw it call cuIpcGetMemHandle", "cannot restore device memory that another process maps"}},
		{"preload: managed memory", map[int]fakeProc{11: {maps: []string{libcuda}}},
			&preloadctl.Report{PID: 11, Reason: "the program called cuMemAllocManaged"}, nil},
		{"preload: capable", map[int]fakeProc{11: {maps: []string{libcuda, libnccl}}},
			&preloadctl.Report{PID: 11, Capable: true}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.report != nil {
				p := tc.procs[11]
				p.maps = append(p.maps, preload)
				tc.procs[11] = p
				fakePreload(t, 11, *tc.report)
			}
			fakeProcRoot(t, tc.procs)
			var pids []int
			for pid := range tc.procs {
				pids = append(pids, pid)
			}
			err := CheckUndoable(context.Background(), pids, true)
			if len(tc.refused) == 0 {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if !errors.Is(err, ErrOneWay) {
				t.Fatalf("err = %v, want ErrOneWay", err)
			}
			for _, s := range tc.refused {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("the refusal lacks %q: %v", s, err)
				}
			}
			if tc.report != nil && strings.Contains(err.Error(), "gpucr-stream run") {
				t.Errorf("a process that runs with the library is pointed to `gpucr-stream run`: %v", err)
			}
		})
	}
}

// scripted is the fake driver with failures per process ("lock 12" answers
// its code), and every call logged, failed or not.
type scripted struct {
	*drivertest.Fake
	fail  map[string]cudadriver.Result
	mu    sync.Mutex // checkpoints and restores of a tree run at once
	calls []string
}

func newScripted(fail map[string]cudadriver.Result, pids ...int) *scripted {
	f := drivertest.NewFake(pids[0])
	for _, p := range pids {
		f.States[p] = cudadriver.StateRunning
	}
	return &scripted{Fake: f, fail: fail}
}

func (d *scripted) call(op string, pid int, real func() error) error {
	d.mu.Lock()
	d.calls = append(d.calls, fmt.Sprintf("%s %d", op, pid))
	d.mu.Unlock()
	if code, ok := d.fail[fmt.Sprintf("%s %d", op, pid)]; ok {
		return &cudadriver.Error{Op: op, PID: pid, Code: code}
	}
	return real()
}

func (d *scripted) Lock(pid int, t time.Duration) error {
	return d.call("lock", pid, func() error { return d.Fake.Lock(pid, t) })
}
func (d *scripted) Checkpoint(pid int) error {
	return d.call("checkpoint", pid, func() error { return d.Fake.Checkpoint(pid) })
}
func (d *scripted) Restore(pid int, p []cudadriver.GPUPair) error {
	return d.call("restore", pid, func() error { return d.Fake.Restore(pid, p) })
}
func (d *scripted) Unlock(pid int) error {
	return d.call("unlock", pid, func() error { return d.Fake.Unlock(pid) })
}

// log lists the calls in order; a run of calls of one step that ran at
// once (checkpoints in Suspend, restores in resumeRestored) in the order
// of their pids.
func (d *scripted) log() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return strings.Join(atOnce(d.calls), ", ")
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

// TestSuspendAllOrNothing: the second process of a tree cannot be locked
// (an NCCL rank whose collective waits for the first, locked one): the
// first is unlocked at once, nothing is checkpointed, and the error names
// both.
func TestSuspendAllOrNothing(t *testing.T) {
	d := newScripted(map[string]cudadriver.Result{"lock 12": cudadriver.ErrorNotReady}, 11, 12)
	cc := &Checkpoint{drv: d, pids: []int{11, 12}}
	_, err := cc.Suspend(context.Background(), 0)
	if got, want := d.log(), "lock 11, lock 12, unlock 11"; got != want {
		t.Fatalf("driver calls %q, want %q", got, want)
	}
	for _, pid := range []int{11, 12} {
		if st := d.StateOf(pid); st != cudadriver.StateRunning {
			t.Errorf("process %d is %s", pid, st)
		}
	}
	var stuck *StuckError
	if err == nil || errors.As(err, &stuck) {
		t.Fatalf("err = %v, want a failure that left every process running", err)
	}
	for _, s := range []string{"process 12 could not be locked", "CUDA_ERROR_NOT_READY", "process 11, locked before it, is unlocked at once", "runs on"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("the error lacks %q: %v", s, err)
		}
	}
}

// TestNCCLRefusedBeforeLock: a tree whose CUDA process maps libnccl and
// NCCL's shared memory is refused by the checks a checkpoint and `gpu
// suspend` run first: the driver never hears of it.
func TestNCCLRefusedBeforeLock(t *testing.T) {
	const pid = 11
	fakeProcRoot(t, map[int]fakeProc{pid: {maps: []string{libcuda, libnccl, "/dev/shm/nccl-Q1w2E3"}}})
	d := newScripted(nil, pid)
	c := CUDA{Mode: CUDAOn, OpenDriver: func() (cudadriver.Driver, error) { return d, nil }, FindProcs: drivertest.Find(pid)}
	cc, err := Find(c, pid)
	if err != nil {
		t.Fatal(err)
	}
	if err := cc.CheckDumpable(context.Background(), []int{pid}, []string{"--tcp-established"}, FastPath{}); !errors.Is(err, ErrOneWay) {
		t.Fatalf("checkpoint's check: %v, want ErrOneWay", err)
	}
	if _, err := GPUStep(context.Background(), d, GPUStepOptions{Action: "suspend", PID: pid, FindProcs: drivertest.Find(pid)}); !errors.Is(err, ErrOneWay) {
		t.Fatalf("gpu suspend: %v, want ErrOneWay", err)
	}
	if d.log() != "" || d.StateOf(pid) != cudadriver.StateRunning {
		t.Fatalf("the driver was called (%q), process %s", d.log(), d.StateOf(pid))
	}
}

// TestUndoReportsStates: a dump fails after the GPU step and the undo
// fails for two of three processes, as driver 580's did for NCCL ranks:
// the error (and its JSON) says where each is left and the command that
// brings it back.
func TestUndoReportsStates(t *testing.T) {
	d := newScripted(map[string]cudadriver.Result{"restore 12": cudadriver.ErrorNotSupported, "unlock 13": cudadriver.ErrorIllegalState}, 11, 12, 13)
	cc := &Checkpoint{drv: d, pids: []int{11, 12, 13}}
	if _, err := cc.Suspend(context.Background(), 0); err != nil {
		t.Fatal(err)
	}
	cause := errors.New("criu dump failed")
	err := cc.Undo(cause)
	var stuck *StuckError
	if !errors.As(err, &stuck) || !errors.Is(err, cause) {
		t.Fatalf("err = %v, want a StuckError wrapping the cause", err)
	}
	want := []ProcState{
		{PID: 11, State: "running"},
		{PID: 12, State: "checkpointed", Recover: "`gpucr-stream gpu restore --pid 12`, then `gpucr-stream gpu unlock --pid 12` (the driver refused this restore once, CUDA_ERROR_NOT_SUPPORTED: if it does again, stopping the process is all that is left)"},
		{PID: 13, State: "locked", Recover: "`gpucr-stream gpu unlock --pid 13`"},
	}
	if fmt.Sprint(stuck.Procs) != fmt.Sprint(want) {
		t.Fatalf("states %+v, want %+v", stuck.Procs, want)
	}
	for _, s := range []string{"criu dump failed", "undoing the GPU step of [11 12 13] failed too", "CUDA_ERROR_NOT_SUPPORTED",
		"process 12 is checkpointed: `gpucr-stream gpu restore --pid 12`", "process 13 is locked: `gpucr-stream gpu unlock --pid 13`"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("the error lacks %q: %v", s, err)
		}
	}
	js, _ := json.Marshal(stuck.Procs)
	if !strings.Contains(string(js), `{"pid":12,"state":"checkpointed","recover":`) {
		t.Errorf("JSON %s", js)
	}
}
