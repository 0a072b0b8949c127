//go:build linux && !nocuda

package cudadriver

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

func TestOpenMissingLibrary(t *testing.T) {
	_, err := OpenLibrary(filepath.Join(t.TempDir(), "libcuda.so.1"))
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("OpenLibrary(missing) = %v, want ErrNoDriver", err)
	}
	for _, want := range []string{"no CUDA driver", "cannot load", "libcuda.so.1", "GPUCR_LIBCUDA"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	t.Logf("missing library: %v", err)
}

func TestOpenNotACUDALibrary(t *testing.T) {
	// Any shared library without cuInit: libc is there on every Linux host.
	libc := ""
	for _, p := range []string{"/lib/x86_64-linux-gnu/libc.so.6", "/lib/aarch64-linux-gnu/libc.so.6", "/lib64/libc.so.6", "/usr/lib/libc.so.6"} {
		if _, err := os.Stat(p); err == nil {
			libc = p
			break
		}
	}
	if libc == "" {
		t.Skip("no libc.so.6 found")
	}
	_, err := OpenLibrary(libc)
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("OpenLibrary(libc) = %v, want ErrNoDriver", err)
	}
	if !strings.Contains(err.Error(), "not a CUDA driver library") {
		t.Errorf("error %q does not say it is not a CUDA library", err)
	}
}

// TestStateAcrossStackGrowth reads the state through the fake driver at
// every stack depth around a growth of the goroutine's stack: the driver
// writes its answer through a pointer, which must not be left pointing
// into a stack the runtime has moved (a state read back as -1 once).
func TestStateAcrossStackGrowth(t *testing.T) {
	l, err := OpenLibrary(fakeLibcuda(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("GPUCR_FAKE_CUDA_STATE", "") // restored after the test
	os.Unsetenv("GPUCR_FAKE_CUDA_STATE")  // the fake's in-memory states
	for depth := 0; depth < 2000; depth++ {
		done := make(chan State)
		go func() { done <- stateAtDepth(l, depth) }()
		if st := <-done; st != StateRunning {
			t.Fatalf("at stack depth %d: state %v, want running", depth, st)
		}
	}
}

// stateAtDepth calls l.State n frames deep, each frame a little stack.
func stateAtDepth(l Driver, n int) State {
	var pad [64]byte
	if n > 0 {
		pad[n%64] = byte(n)
		st := stateAtDepth(l, n-1)
		runtime.KeepAlive(&pad) // keep the frame its size
		return st
	}
	st, err := l.State(4242)
	if err != nil {
		return StateFailed
	}
	return st
}

// fakeLibcuda builds the fake driver (preload/testdata/fake_cuda.c). It
// needs a C compiler: in CI (CI=true) its absence fails the test.
func fakeLibcuda(t *testing.T) string {
	t.Helper()
	cc, err := exec.LookPath("cc")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("no C compiler (cc): the fake driver needs one in CI")
		}
		t.Skip("no C compiler (cc)")
	}
	lib := filepath.Join(t.TempDir(), LibraryName)
	src := filepath.Join("..", "preload", "testdata", "fake_cuda.c")
	if out, err := exec.Command(cc, "-O2", "-Wall", "-fPIC", "-shared", "-o", lib, src).CombinedOutput(); err != nil {
		t.Fatalf("build the fake driver: %v\n%s", err, out)
	}
	return lib
}
