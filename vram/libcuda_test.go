//go:build linux && !nocuda

package vram

import (
	"errors"
	"os"
	"path/filepath"
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
