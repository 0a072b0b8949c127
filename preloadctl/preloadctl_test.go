package preloadctl

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestEnv: the library goes first in LD_PRELOAD, ahead of what the
// caller preloads, and nothing else of the environment changes.
func TestEnv(t *testing.T) {
	const lib = "/x/libgpucr-preload.so"
	tests := []struct {
		name string
		env  []string
		want []string
	}{
		{"none", []string{"A=1"}, []string{"A=1", "LD_PRELOAD=" + lib}},
		{"empty", []string{"LD_PRELOAD=", "A=1"}, []string{"A=1", "LD_PRELOAD=" + lib}},
		{"kept", []string{"LD_PRELOAD=/y/a.so:/y/b.so", "A=1"}, []string{"A=1", "LD_PRELOAD=" + lib + ":/y/a.so:/y/b.so"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			in := slices.Clone(tc.env)
			if got := Env(tc.env, lib); !slices.Equal(got, tc.want) {
				t.Fatalf("Env(%q) = %q, want %q", tc.env, got, tc.want)
			}
			if !slices.Equal(in, tc.env) {
				t.Fatalf("Env changed its input: %q", tc.env)
			}
		})
	}
}

// TestLookPath finds executables on PATH only.
func TestLookPath(t *testing.T) {
	dir := t.TempDir()
	for name, mode := range map[string]os.FileMode{"prog": 0o755, "data": 0o644} {
		if err := os.WriteFile(filepath.Join(dir, name), nil, mode); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PATH", "/nonexistent:"+dir)
	if p, err := lookPath("prog"); err != nil || p != filepath.Join(dir, "prog") {
		t.Fatalf("lookPath(prog) = %q, %v", p, err)
	}
	for _, name := range []string{"data", "missing"} {
		if _, err := lookPath(name); err == nil || !strings.Contains(err.Error(), "not found on PATH") {
			t.Errorf("lookPath(%s): %v", name, err)
		}
	}
}
