// Package fsat reaches files only through directory descriptors that were
// checked, never through a path another user could change meanwhile.
//
// gpucr-stream runs as root and checkpoints processes of other users. What
// it creates for them (the kept copy of device memory, its records) must
// not be redirected by a symlink or a renamed directory into a file of
// root's. So a directory is opened once (OpenOwned: not a symlink, owned
// by us, writable by nobody else), and everything under it goes through
// that descriptor with openat2(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS):
// nothing below it can lead outside, whatever happens to the path above.
package fsat

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrUnsafe says a directory or file is not what gpucr-stream may use: a
// symlink, another owner, writable by others, not a regular file.
var ErrUnsafe = errors.New("not safe to use")

// openat2 is unix.Openat2; a variable so that tests can take the way of
// kernels before 5.6.
var openat2 = unix.Openat2

const beneath = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

// OpenOwned opens the directory at path (its last component must not be
// a symlink) and checks that it is ours and that no one else can write
// into it.
func OpenOwned(path string) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	if err := CheckOwned(f); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// MkdirOwned makes path (and its parents, 0700) where missing, then opens
// it with OpenOwned.
func MkdirOwned(path string) (*os.File, error) {
	if err := os.MkdirAll(path, 0o700); err != nil {
		return nil, err
	}
	return OpenOwned(path)
}

// CheckOwned checks that the directory f is ours and writable by no one
// else.
func CheckOwned(f *os.File) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("stat %s: %w", f.Name(), err)
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return fmt.Errorf("%s: %w: not a directory", f.Name(), ErrUnsafe)
	case int(st.Uid) != os.Geteuid():
		return fmt.Errorf("%s: %w: owned by uid %d, not by uid %d", f.Name(), ErrUnsafe, st.Uid, os.Geteuid())
	case st.Mode&0o022 != 0:
		return fmt.Errorf("%s: %w: writable by others (mode %#o)", f.Name(), ErrUnsafe, st.Mode&0o777)
	}
	return nil
}

// Open opens name beneath dir (no symlink, no "..", nothing outside)
// with flags, and checks that it is a regular file.
func Open(dir *os.File, name string, flags int) (*os.File, error) {
	return openat(dir, name, flags, 0, unix.S_IFREG)
}

// Create creates name beneath dir: a new regular file of mode perm (it
// fails if name exists), opened with flags.
func Create(dir *os.File, name string, flags int, perm uint32) (*os.File, error) {
	return openat(dir, name, flags|unix.O_CREAT|unix.O_EXCL, perm, unix.S_IFREG)
}

// CreateUnnamed creates an unnamed regular file in dir (O_TMPFILE), open
// for reading and writing, of mode 0600: its memory or blocks go with its
// last descriptor.
func CreateUnnamed(dir *os.File) (*os.File, error) {
	fd, err := unix.Openat(int(dir.Fd()), ".", unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("an unnamed file in %s: %w", dir.Name(), err)
	}
	return os.NewFile(uintptr(fd), dir.Name()), nil
}

// OpenDir opens the directory name beneath dir.
func OpenDir(dir *os.File, name string) (*os.File, error) {
	return openat(dir, name, unix.O_RDONLY|unix.O_DIRECTORY, 0, unix.S_IFDIR)
}

func openat(dir *os.File, name string, flags int, perm uint32, kind uint32) (*os.File, error) {
	path := filepath.Join(dir.Name(), name)
	how := unix.OpenHow{Flags: uint64(flags | unix.O_NOFOLLOW | unix.O_CLOEXEC), Mode: uint64(perm), Resolve: beneath}
	fd, err := openat2(int(dir.Fd()), name, &how)
	if errors.Is(err, unix.ENOSYS) {
		// Before Linux 5.6: one component, not "..", with O_NOFOLLOW, is
		// beneath dir and no symlink too.
		if name == ".." || name == "" || strings.Contains(name, "/") {
			err = unix.EXDEV
		} else {
			fd, err = unix.Openat(int(dir.Fd()), name, int(how.Flags), perm)
		}
	}
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != kind {
		f.Close()
		if err == nil {
			err = ErrUnsafe
		}
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	return f, nil
}

// Same says whether a and b are the same file.
func Same(a, b *os.File) bool {
	var sa, sb unix.Stat_t
	return unix.Fstat(int(a.Fd()), &sa) == nil && unix.Fstat(int(b.Fd()), &sb) == nil && sa.Dev == sb.Dev && sa.Ino == sb.Ino
}

// ID is a file's device and inode.
type ID struct{ Dev, Ino uint64 }

// IDOf is f's ID.
func IDOf(f *os.File) (ID, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return ID{}, fmt.Errorf("stat %s: %w", f.Name(), err)
	}
	return ID{st.Dev, st.Ino}, nil
}

// RemoveAll removes name beneath dir and, for a directory, what it holds,
// without following a symlink anywhere (a symlink is removed, not what it
// names). A name that is not there is no error.
func RemoveAll(dir *os.File, name string) error {
	err := unix.Unlinkat(int(dir.Fd()), name, 0)
	if err == nil || errors.Is(err, unix.ENOENT) {
		return nil
	}
	if !errors.Is(err, unix.EISDIR) && !errors.Is(err, unix.EPERM) {
		return &os.PathError{Op: "remove", Path: filepath.Join(dir.Name(), name), Err: err}
	}
	sub, err := OpenDir(dir, name)
	if err != nil {
		return err
	}
	err = Empty(sub)
	sub.Close()
	if err != nil {
		return err
	}
	if err := unix.Unlinkat(int(dir.Fd()), name, unix.AT_REMOVEDIR); err != nil && !errors.Is(err, unix.ENOENT) {
		return &os.PathError{Op: "remove", Path: filepath.Join(dir.Name(), name), Err: err}
	}
	return nil
}

// Empty removes everything in dir (RemoveAll of each entry).
func Empty(dir *os.File) error {
	names, err := Names(dir)
	for _, n := range names {
		if rerr := RemoveAll(dir, n); rerr != nil && err == nil {
			err = rerr
		}
	}
	return err
}

// Names lists dir's entries (through a descriptor of its own, so that
// dir's offset stays).
func Names(dir *os.File) ([]string, error) {
	d, err := OpenDir(dir, ".")
	if err != nil {
		return nil, err
	}
	defer d.Close()
	return d.Readdirnames(-1)
}
