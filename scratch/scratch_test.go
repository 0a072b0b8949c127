package scratch

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/proc"
	"golang.org/x/sys/unix"
)

// mountOptions is the fstype and super options of the mount at dir, if
// dir is a mount point.
func mountOptions(t *testing.T, dir string) (string, bool) {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) > 4 && f[4] == dir {
			_, rest, _ := strings.Cut(l, " - ")
			return rest, true
		}
	}
	return "", false
}

func TestNew(t *testing.T) {
	root := filepath.Join(t.TempDir(), "run")
	t.Setenv("TMPDIR", t.TempDir())
	refuse := func(string, int64) error { return unix.EPERM }
	avail := proc.AvailableMemory()
	if avail <= 0 {
		t.Fatal("no MemAvailable")
	}
	for _, tc := range []struct {
		name    string
		base    string
		need    int64
		refuse  bool
		mounted bool
		why     string // in Why
		under   string // Path's parent
	}{
		{name: "user's dir", base: t.TempDir(), need: 1 << 20},
		{name: "own tmpfs", need: 1 << 20, mounted: os.Geteuid() == 0, why: map[bool]string{true: "", false: "mount"}[os.Geteuid() == 0]},
		{name: "too big for memory", need: avail, why: "three quarters"},
		{name: "mount refused", need: 1 << 20, refuse: true, why: "operation not permitted"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.refuse {
				old := mount
				mount = refuse
				defer func() { mount = old }()
			}
			k, err := New(root, tc.base, "gpucr-test-", tc.need)
			if err != nil {
				t.Fatal(err)
			}
			parent := filepath.Dir(k.Path)
			switch {
			case tc.base != "":
				if parent != tc.base || k.Mounted || k.Why != "" {
					t.Fatalf("%+v, want a dir in %s as it is", k, tc.base)
				}
			case tc.mounted:
				if parent != root || !k.Mounted {
					t.Fatalf("%+v, want a tmpfs of its own under %s", k, root)
				}
				opts, ok := mountOptions(t, k.Path)
				if !ok || !strings.HasPrefix(opts, "tmpfs ") || !strings.Contains(opts, "huge=always") {
					t.Fatalf("mount at %s: %q (%v), want a tmpfs with huge=always", k.Path, opts, ok)
				}
			default:
				if parent != os.Getenv("TMPDIR") || k.Mounted || !strings.Contains(k.Why, tc.why) {
					t.Fatalf("%+v, want a dir in $TMPDIR and why %q", k, tc.why)
				}
				if ents, _ := os.ReadDir(root); len(ents) != 0 {
					t.Fatalf("%d entries left in %s after the fallback", len(ents), root)
				}
			}
			if err := os.WriteFile(filepath.Join(k.Path, "vram-1-00.bin"), make([]byte, 3<<20), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := k.Remove(); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(k.Path); !os.IsNotExist(err) {
				t.Fatalf("%s after Remove: %v, want gone", k.Path, err)
			}
			if _, ok := mountOptions(t, k.Path); ok {
				t.Fatalf("%s still mounted after Remove", k.Path)
			}
		})
	}
}

// TestSweep: a mount a killed run left, emptied and old, goes at the next
// New; one just made, one still holding a copy, and a directory that is no
// mount stay.
func TestSweep(t *testing.T) {
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI runs the tests as root: mounting a tmpfs needs it")
		}
		t.Skip("mounting a tmpfs needs root")
	}
	root := filepath.Join(t.TempDir(), "run")
	mk := func() *Dir {
		d, err := New(root, "", "gpucr-test-", 1<<20)
		if err != nil || !d.Mounted {
			t.Fatalf("New: %+v %v", d, err)
		}
		return d
	}
	old := time.Now().Add(-time.Hour)
	stale, fresh, full := mk(), mk(), mk()
	defer fresh.Remove()
	defer full.Remove()
	if err := os.WriteFile(filepath.Join(full.Path, "kept"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	plain := filepath.Join(root, "gpucr-test-plain")
	if err := os.Mkdir(plain, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{stale.Path, full.Path, plain} {
		if err := os.Chtimes(p, old, old); err != nil {
			t.Fatal(err)
		}
	}
	next := mk()
	defer next.Remove()
	if _, ok := mountOptions(t, stale.Path); ok {
		t.Fatalf("stale empty mount %s not swept", stale.Path)
	}
	if _, err := os.Stat(stale.Path); !os.IsNotExist(err) {
		t.Fatalf("stale mount's directory %s: %v, want removed", stale.Path, err)
	}
	for _, p := range []string{fresh.Path, full.Path} {
		if _, ok := mountOptions(t, p); !ok {
			t.Fatalf("%s swept, want kept", p)
		}
	}
	if _, err := os.Stat(plain); err != nil {
		t.Fatalf("a directory that is no mount was touched: %v", err)
	}
}
