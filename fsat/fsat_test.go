package fsat

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestOpenBeneath: nothing reached through a directory's descriptor leads
// outside it or through a symlink, and Create makes only new files; also
// where the kernel has no openat2.
func TestOpenBeneath(t *testing.T) {
	t.Run("openat2", testOpenBeneath)
	t.Run("no openat2", func(t *testing.T) {
		old := openat2
		openat2 = func(int, string, *unix.OpenHow) (int, error) { return -1, unix.ENOSYS }
		defer func() { openat2 = old }()
		testOpenBeneath(t)
	})
}

func testOpenBeneath(t *testing.T) {
	base := t.TempDir()
	outside := filepath.Join(base, "outside")
	if err := os.WriteFile(outside, []byte("root's"), 0o600); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(base, "d")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	for name, target := range map[string]string{"link": outside, "rel": "../outside"} {
		if err := os.Symlink(target, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "file"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "sub"), 0o700); err != nil {
		t.Fatal(err)
	}
	d, err := OpenOwned(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	for _, tc := range []struct {
		name   string
		create bool
		ok     bool
	}{
		{"file", false, true},
		{"file", true, false}, // exists
		{"new", true, true},
		{"link", false, false},
		{"link", true, false},
		{"rel", false, false},
		{"../outside", false, false},
		{outside, false, false},
		{"sub", false, false}, // not a regular file
	} {
		var f *os.File
		if tc.create {
			f, err = Create(d, tc.name, unix.O_WRONLY|unix.O_TRUNC, 0o600)
		} else {
			f, err = Open(d, tc.name, unix.O_RDWR|unix.O_TRUNC)
		}
		if (err == nil) != tc.ok {
			t.Errorf("%s (create %v): %v, want ok %v", tc.name, tc.create, err, tc.ok)
		}
		if f != nil {
			f.Close()
		}
	}
	if b, err := os.ReadFile(outside); err != nil || string(b) != "root's" {
		t.Fatalf("the file outside: %q %v", b, err)
	}
	// RemoveAll takes the symlinks, not what they name.
	if err := Empty(d); err != nil {
		t.Fatal(err)
	}
	if names, _ := Names(d); len(names) != 0 {
		t.Fatalf("left after Empty: %v", names)
	}
	if _, err := os.Stat(outside); err != nil {
		t.Fatalf("the file outside after Empty: %v", err)
	}
}

// TestOpenOwned: a directory that is a symlink, another user's, or
// writable by others is refused.
func TestOpenOwned(t *testing.T) {
	base := t.TempDir()
	mk := func(name string, mode os.FileMode, uid int) string {
		p := filepath.Join(base, name)
		if err := os.Mkdir(p, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		if uid != os.Geteuid() {
			if err := os.Chown(p, uid, uid); err != nil {
				if os.Getenv("CI") == "true" {
					t.Fatalf("CI runs the tests as root: %v", err)
				}
				t.Skipf("chown needs root: %v", err)
			}
		}
		return p
	}
	link := filepath.Join(base, "link")
	if err := os.Symlink(mk("target", 0o700, os.Geteuid()), link); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, path string
		unsafe     bool
	}{
		{"ours", mk("ours", 0o700, os.Geteuid()), false},
		{"readable by others", mk("readable", 0o755, os.Geteuid()), false},
		{"writable by others", mk("writable", 0o777, os.Geteuid()), true},
		{"symlink", link, false},
		{"another owner", mk("other", 0o700, 65534), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, err := OpenOwned(tc.path)
			if d != nil {
				d.Close()
			}
			switch {
			case tc.name == "symlink":
				if !errors.Is(err, unix.ENOTDIR) && !errors.Is(err, unix.ELOOP) {
					t.Fatalf("%v, want a symlink refused", err)
				}
			case tc.unsafe != errors.Is(err, ErrUnsafe):
				t.Fatalf("%v, want unsafe %v", err, tc.unsafe)
			case !tc.unsafe && err != nil:
				t.Fatal(err)
			}
		})
	}
}

// TestCreateUnnamed: the file is there to write and read, under no name.
func TestCreateUnnamed(t *testing.T) {
	dir, err := os.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	f, err := CreateUnnamed(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt([]byte("kept"), 0); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	if _, err := f.ReadAt(b, 0); err != nil || string(b) != "kept" {
		t.Fatalf("read back %q, %v", b, err)
	}
	if names, err := Names(dir); err != nil || len(names) != 0 {
		t.Fatalf("the directory holds %v (%v), want nothing", names, err)
	}
}
