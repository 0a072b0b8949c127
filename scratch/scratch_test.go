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
	refuse := func(*os.File, int64) (*os.File, error) { return nil, unix.EPERM }
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

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI runs the tests as root: mounting a tmpfs needs it")
		}
		t.Skip("mounting a tmpfs needs root")
	}
}

// mountVictim mounts a tmpfs that is not ours on dir, with a file in it.
func mountVictim(t *testing.T, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("victim", dir, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	if err := os.WriteFile(filepath.Join(dir, "precious"), []byte("root's"), 0o600); err != nil {
		t.Fatal(err)
	}
}

func mustHoldVictim(t *testing.T, dir string) {
	t.Helper()
	if b, err := os.ReadFile(filepath.Join(dir, "precious")); err != nil || string(b) != "root's" {
		t.Fatalf("the victim's file: %q %v, want it untouched", b, err)
	}
	if _, ok := mountOptions(t, dir); !ok {
		t.Fatalf("%s was unmounted", dir)
	}
}

// TestRemoveSwapped (issue 25 H2): whoever controls a directory above the
// copy's swaps it for a symlink to a directory of root's, a mount point,
// before Remove: Remove empties and unmounts its own mount, and nothing
// else.
func TestRemoveSwapped(t *testing.T) {
	needRoot(t)
	user := filepath.Join(t.TempDir(), "user")
	victim := filepath.Join(t.TempDir(), "victim")
	mountVictim(t, victim)
	root := filepath.Join(user, "run")
	for _, mounted := range []bool{true, false} {
		t.Run(map[bool]string{true: "mounted", false: "plain"}[mounted], func(t *testing.T) {
			os.RemoveAll(user)
			var d *Dir
			var err error
			if mounted {
				d, err = New(root, "", "gpucr-test-", 1<<20)
			} else {
				os.MkdirAll(root, 0o700)
				d, err = New("", root, "gpucr-test-", 1<<20)
			}
			if err != nil || d.Mounted != mounted {
				t.Fatalf("New: %+v %v", d, err)
			}
			if err := os.WriteFile(filepath.Join(d.Path, "vram-1-00.bin"), []byte("x"), 0o600); err != nil {
				t.Fatal(err)
			}
			real := filepath.Join(user+".old", "run", filepath.Base(d.Path))
			os.RemoveAll(user + ".old")
			if err := os.Rename(user, user+".old"); err != nil {
				t.Fatal(err)
			}
			if err := os.MkdirAll(root, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(victim, d.Path); err != nil {
				t.Fatal(err)
			}
			if err := d.Remove(); err != nil {
				t.Fatal(err)
			}
			mustHoldVictim(t, victim)
			if _, ok := mountOptions(t, real); ok {
				t.Fatalf("the copy's own mount %s is still there", real)
			}
			if _, err := os.Stat(real); !os.IsNotExist(err) {
				t.Fatalf("the copy %s: %v, want removed", real, err)
			}
		})
	}
}

// TestNewRootNotOurs: a root directory another user owns (or may write
// into) gets no mount of ours: the copy goes into $TMPDIR, and says why.
func TestNewRootNotOurs(t *testing.T) {
	needRoot(t)
	t.Setenv("TMPDIR", t.TempDir())
	for _, tc := range []struct {
		name string
		mode os.FileMode
		uid  int
		why  string
	}{
		{"another owner", 0o700, 65534, "owned by uid 65534"},
		{"writable by others", 0o777, 0, "writable by others"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := filepath.Join(t.TempDir(), "run")
			if err := os.Mkdir(root, tc.mode); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(root, tc.mode); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(root, tc.uid, tc.uid); err != nil {
				t.Fatal(err)
			}
			d, err := New(root, "", "gpucr-test-", 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			defer d.Remove()
			if d.Mounted || filepath.Dir(d.Path) != os.Getenv("TMPDIR") || !strings.Contains(d.Why, tc.why) {
				t.Fatalf("%+v, want a dir in $TMPDIR because %s", d, tc.why)
			}
		})
	}
	// A symlink in place of the root directory is refused too.
	link := filepath.Join(t.TempDir(), "run")
	if err := os.Symlink(t.TempDir(), link); err != nil {
		t.Fatal(err)
	}
	d, err := New(link, "", "gpucr-test-", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Remove()
	if d.Mounted || !strings.Contains(d.Why, "not a directory") {
		t.Fatalf("%+v, want no mount under a symlink", d)
	}
}

// TestSweepOnlyOurs: an empty, old mount under root named like ours but
// not made by New (its id is not one of our mounts') stays.
func TestSweepOnlyOurs(t *testing.T) {
	needRoot(t)
	root := filepath.Join(t.TempDir(), "run")
	other := filepath.Join(root, "gpucr-test-other")
	mountVictim(t, other)
	os.Remove(filepath.Join(other, "precious"))
	old := time.Now().Add(-time.Hour)
	if err := os.Chtimes(other, old, old); err != nil {
		t.Fatal(err)
	}
	d, err := New(root, "", "gpucr-test-", 1<<20)
	if err != nil || !d.Mounted {
		t.Fatalf("New: %+v %v", d, err)
	}
	defer d.Remove()
	if _, ok := mountOptions(t, other); !ok {
		t.Fatalf("the sweep unmounted %s, a mount that is not ours", other)
	}
}
