package gpuckpt

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/cudadriver/drivertest"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
)

// TestGPUMapAll: all=NEW resolves against the one GPU a checkpoint
// records, and is a usage error for any other number.
func TestGPUMapAll(t *testing.T) {
	const u = "GPU-b9866d0b-7eb7-389c-2420-04c59d30be30"
	to, err := cudadriver.ParseUUID(u)
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
	f := drivertest.NewFake(pid)
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
		res, err := GPUStep(context.Background(), f, GPUStepOptions{Action: s.action, PID: pid, FindProcs: drivertest.Find(pid)})
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

// uuidN is a GPU UUID whose bytes are all n.
func uuidN(n byte) cudadriver.UUID {
	var u cudadriver.UUID
	for i := range u {
		u[i] = n
	}
	return u
}

func pr(o, n cudadriver.UUID) cudadriver.GPUPair { return cudadriver.GPUPair{Old: o, New: n} }

func TestCompletePairs(t *testing.T) {
	a, b, c := uuidN(0xa), uuidN(0xb), uuidN(0xc)
	for _, tc := range []struct {
		name        string
		pairs, want []cudadriver.GPUPair
		host        []cudadriver.UUID
	}{
		{"one of two", []cudadriver.GPUPair{pr(a, b)}, []cudadriver.GPUPair{pr(a, b), pr(b, a)}, []cudadriver.UUID{a, b}},
		{"swap stays", []cudadriver.GPUPair{pr(a, b), pr(b, a)}, []cudadriver.GPUPair{pr(a, b), pr(b, a)}, []cudadriver.UUID{a, b}},
		{"third stays", []cudadriver.GPUPair{pr(a, b)}, []cudadriver.GPUPair{pr(a, b), pr(c, c), pr(b, a)}, []cudadriver.UUID{a, b, c}},
		{"onto itself", []cudadriver.GPUPair{pr(a, a)}, []cudadriver.GPUPair{pr(a, a), pr(b, b)}, []cudadriver.UUID{a, b}},
		{"new not here", []cudadriver.GPUPair{pr(a, c)}, []cudadriver.GPUPair{pr(a, c), pr(b, b)}, []cudadriver.UUID{a, b}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := completePairs(tc.pairs, tc.host)
			if cudadriver.FormatGPUMap(got) != cudadriver.FormatGPUMap(tc.want) {
				t.Fatalf("completePairs = %s, want %s", cudadriver.FormatGPUMap(got), cudadriver.FormatGPUMap(tc.want))
			}
		})
	}
}

// permDriver refuses, as driver 580 did on two H100s, a map that does
// not name every GPU of the host.
type permDriver struct {
	*drivertest.Fake
	gpus  int
	tries []int
}

func (d *permDriver) Restore(pid int, pairs []cudadriver.GPUPair) error {
	d.tries = append(d.tries, len(pairs))
	if len(pairs) > 0 && len(pairs) != d.gpus {
		return fmt.Errorf("%w: CUDA_ERROR_INVALID_VALUE", cudadriver.ErrUnsupported)
	}
	return d.Fake.Restore(pid, pairs)
}

func TestCUDARestoreCompletesMap(t *testing.T) {
	a, b := uuidN(0xa), uuidN(0xb)
	host := func(context.Context) ([]cudadriver.HostGPU, error) {
		return []cudadriver.HostGPU{{UUID: a, Free: 80 << 30}, {UUID: b, Free: 80 << 30}}, nil
	}
	for _, tc := range []struct {
		name      string
		gpus      int
		wantTries []int
		wantErr   bool
	}{
		{"completed", 2, []int{1, 2}, false},
		{"refused both times", 3, []int{1, 2}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const pid = 4242
			fake := drivertest.NewFake(pid)
			fake.States[pid] = cudadriver.StateCheckpointed
			d := &permDriver{Fake: fake, gpus: tc.gpus}
			c := CUDA{OpenDriver: func() (cudadriver.Driver, error) { return d, nil }, FindProcs: drivertest.Find(pid), HostGPUs: host}
			resumed, _, err := Restore(context.Background(), c, pid, []cudadriver.GPUPair{pr(a, b)})
			if fmt.Sprint(d.tries) != fmt.Sprint(tc.wantTries) {
				t.Fatalf("restore tries with %v pairs, want %v", d.tries, tc.wantTries)
			}
			if tc.wantErr {
				if err == nil || !strings.Contains(err.Error(), "completed to every GPU") {
					t.Fatalf("err = %v, want the completed map named", err)
				}
				return
			}
			if err != nil || len(resumed) != 1 || fake.StateOf(pid) != cudadriver.StateRunning {
				t.Fatalf("resumed %v, state %v, err %v", resumed, fake.StateOf(pid), err)
			}
		})
	}
}

func TestCheckMap(t *testing.T) {
	a, b, ghost := uuidN(0xa), uuidN(0xb), uuidN(0xe)
	host := func(context.Context) ([]cudadriver.HostGPU, error) {
		return []cudadriver.HostGPU{{UUID: a, Free: 80 << 30}, {UUID: b, Free: 1 << 30}}, nil
	}
	rec := []manifest.GPU{{UUID: a.String(), Bytes: 7 << 30}, {UUID: b.String(), Bytes: 512 << 20}}
	for _, tc := range []struct {
		name     string
		pairs    []cudadriver.GPUPair
		recorded []manifest.GPU
		want     string // "" : no error
	}{
		{"fits", []cudadriver.GPUPair{pr(b, a)}, rec, ""},
		{"missing GPU", []cudadriver.GPUPair{pr(a, ghost)}, rec, "GPU " + ghost.String() + " is not on this host"},
		{"too little free", []cudadriver.GPUPair{pr(a, b)}, rec, "has 1024 MiB free, the checkpoint's memory mapped onto it needs 7168 MiB"},
		{"swap sums per target", []cudadriver.GPUPair{pr(a, b), pr(b, a)}, rec, "needs 7168 MiB"},
		{"receiver before a sender", []cudadriver.GPUPair{{New: b}}, nil, ""},
		{"no map", nil, rec, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CUDA{HostGPUs: host}.CheckMap(context.Background(), tc.pairs, tc.recorded)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("CheckMap: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, errdefs.ErrUsage) {
				t.Fatalf("CheckMap = %v, want a usage error with %q", err, tc.want)
			}
		})
	}
}

// TestCheckDumpable: a CUDA tree holding an established TCP connection is
// refused before the GPU step unless CRIU is told to dump it; a tree
// without CUDA processes is left to CRIU.
func TestCheckDumpable(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	self := []int{os.Getpid()}
	cuda := &Checkpoint{pids: self}
	if err := cuda.CheckDumpable(context.Background(), self, nil, FastPath{}); err != nil {
		t.Fatalf("a listener alone: %v", err)
	}
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, tc := range []struct {
		name    string
		cc      *Checkpoint
		args    []string
		refused bool
	}{
		{"cuda", cuda, nil, true},
		{"cuda-other-opts", cuda, []string{"--shell-job"}, true},
		{"cuda-tcp-established", cuda, []string{"--shell-job", "--tcp-established"}, false},
		{"cuda-tcp-close", cuda, []string{"--tcp-close"}, false},
		{"no-cuda", nil, nil, false},
	} {
		err := tc.cc.CheckDumpable(context.Background(), self, tc.args, FastPath{})
		if tc.refused != (err != nil) {
			t.Errorf("%s: refused=%v, got %v", tc.name, tc.refused, err)
			continue
		}
		if err != nil && (!errors.Is(err, errdefs.ErrUsage) || !strings.Contains(err.Error(), c.LocalAddr().String()) || !strings.Contains(err.Error(), "--tcp-established")) {
			t.Errorf("%s: the error must be a usage error naming the connection and the option: %v", tc.name, err)
		}
	}
}

// initCounting is a driver that counts its Init calls.
type initCounting struct {
	*drivertest.Fake
	inits int
}

func (d *initCounting) Init() error { d.inits++; return nil }

// TestWarm: Warm initialises the driver once, and never with --cuda off
// or without a driver.
func TestWarm(t *testing.T) {
	for _, tc := range []struct {
		mode  CUDAMode
		open  bool
		inits int
	}{
		{CUDAAuto, true, 1},
		{CUDAOn, true, 1},
		{CUDAOff, true, 0},
		{CUDAAuto, false, 0},
	} {
		d := &initCounting{Fake: drivertest.NewFake(1)}
		opened := 0
		c := CUDA{Mode: tc.mode, OpenDriver: func() (cudadriver.Driver, error) {
			opened++
			if !tc.open {
				return nil, cudadriver.ErrNoDriver
			}
			return d, nil
		}}
		c.Warm()
		if d.inits != tc.inits || (tc.mode == CUDAOff && opened != 0) {
			t.Errorf("mode %q, driver %v: %d inits, %d opens; want %d inits", tc.mode, tc.open, d.inits, opened, tc.inits)
		}
	}
}
