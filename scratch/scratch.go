// Package scratch makes the directories that hold a copy in memory until a
// commit: the fast path's kept copy of device memory, the local copy a
// migration keeps until the receiver has restored.
//
// How those copies' pages are allocated bounds the steps that write them.
// On an H100 host 16 writers filled a tmpfs of small pages at 14.5 to
// 31.5 GB/s and one mounted with huge=always at 39.5 to 47.5 GB/s (the
// fast path's copy out of 13.2 GB: 0.82 s against 0.46 s); a migration
// whose local copy went into /dev/shm was down 8.88 s, 6.77 s with the
// copy on a tmpfs of huge pages. No host setting gives /dev/shm or a memfd
// huge pages, but a tmpfs of our own can ask for them. So by default each
// copy gets one, in a directory of its own under a root directory the
// caller names, unmounted when the copy is dropped.
//
// Where it cannot (not root, no tmpfs, a root directory that is not ours
// alone, or the copy would take more than three quarters of the memory
// available, since a tmpfs lives in memory), the copy goes into $TMPDIR.
// A directory the user names is used as it is. A copy that must outlive
// the process that made it (a gpucr-stream killed meanwhile; a migration
// whose receiver failed) stays in its mount; Remove takes both away.
// Mounts that such a run left behind, once emptied and untouched for a
// while, are unmounted by the next New.
//
// Root makes these for processes of other users, so nothing here goes by
// a path once the directory exists (package fsat): the root directory must
// be ours alone, the copy's directory is held open, the tmpfs is made with
// the mount API on that descriptor, and Remove and the sweep empty and
// unmount through descriptors, only a mount whose id says it is one of
// ours (docs/THREATS.md).
package scratch

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/fsat"
	"github.com/gpucr/gpucr-stream/proc"
	"golang.org/x/sys/unix"
)

// DefaultRoot is the root directory for the tmpfs mounts: root's own
// (mounting needs root; anyone else falls back to $TMPDIR).
const DefaultRoot = "/run/gpucr-stream"

// source names our mounts in /proc/self/mountinfo: the sweep takes no
// other.
const source = "gpucr-scratch"

// Dir is a directory for a copy held until a commit.
type Dir struct {
	Path string
	// Mounted: Path is a tmpfs of its own (huge pages), unmounted by
	// Remove. Else Why says why not (empty when the user chose the dir).
	Mounted bool
	Why     string
	// parent holds dir as name; dir is the directory (for a mount, its
	// root), mntID the mount's id.
	parent, dir *os.File
	name        string
	mntID       uint64
}

// File is the directory, held open: create and open what goes in it
// through this (fsat), not through Path.
func (d *Dir) File() *os.File { return d.dir }

// mount mounts a tmpfs of size bytes on the directory dir and returns its
// root; a variable so that tests can refuse.
var mount = func(dir *os.File, size int64) (*os.File, error) {
	fs, err := unix.Fsopen("tmpfs", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("fsopen: %w", err)
	}
	defer unix.Close(fs)
	for _, kv := range [][2]string{{"source", source}, {"mode", "0700"}, {"huge", "always"}, {"size", strconv.FormatInt(size, 10)}} {
		if err := unix.FsconfigSetString(fs, kv[0], kv[1]); err != nil {
			return nil, fmt.Errorf("tmpfs option %s=%s: %w", kv[0], kv[1], err)
		}
	}
	if err := unix.FsconfigCreate(fs); err != nil {
		return nil, fmt.Errorf("create a tmpfs: %w", err)
	}
	m, err := unix.Fsmount(fs, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOEXEC)
	if err != nil {
		return nil, fmt.Errorf("fsmount: %w", err)
	}
	root := os.NewFile(uintptr(m), dir.Name())
	if err := unix.MoveMount(m, "", int(dir.Fd()), "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		root.Close()
		return nil, fmt.Errorf("move_mount: %w", err)
	}
	return root, nil
}

// New makes a directory named prefix* for a copy of about need bytes (an
// estimate will do: it only decides whether memory can hold it): in
// base when given, else on a tmpfs of its own under root when it can, else
// in $TMPDIR.
func New(root, base, prefix string, need int64) (*Dir, error) {
	if base != "" {
		d, err := plain(base, prefix)
		if err != nil {
			return nil, fmt.Errorf("scratch directory: %w", err)
		}
		return d, nil
	}
	d, err := mounted(root, prefix, need)
	if err == nil {
		return d, nil
	}
	d, err2 := plain(os.TempDir(), prefix)
	if err2 != nil {
		return nil, fmt.Errorf("scratch directory: %w (a tmpfs of its own: %v)", err2, err)
	}
	d.Why = err.Error()
	return d, nil
}

// plain makes a fresh directory prefix* in base, as the user named it.
func plain(base, prefix string) (*Dir, error) {
	parent, err := os.Open(base)
	if err != nil {
		return nil, err
	}
	d, err := mkdir(parent, prefix)
	if err != nil {
		parent.Close()
		return nil, err
	}
	return d, nil
}

// mkdir makes a fresh directory prefix* (0700) in parent and holds it:
// only ours, and empty, will do.
func mkdir(parent *os.File, prefix string) (*Dir, error) {
	for range 100 {
		var b [6]byte
		rand.Read(b[:])
		name := prefix + hex.EncodeToString(b[:])
		err := unix.Mkdirat(int(parent.Fd()), name, 0o700)
		if errors.Is(err, unix.EEXIST) {
			continue
		}
		if err != nil {
			return nil, &os.PathError{Op: "mkdir", Path: filepath.Join(parent.Name(), name), Err: err}
		}
		dir, err := fsat.OpenDir(parent, name)
		if err == nil {
			err = fsat.CheckOwned(dir)
			if names, _ := fsat.Names(dir); err == nil && len(names) != 0 {
				err = fmt.Errorf("%s: %w: not the empty directory just made", dir.Name(), fsat.ErrUnsafe)
			}
			if err != nil {
				dir.Close()
			}
		}
		if err != nil {
			return nil, err
		}
		return &Dir{Path: dir.Name(), parent: parent, dir: dir, name: name}, nil
	}
	return nil, fmt.Errorf("mkdir %s: no free name", filepath.Join(parent.Name(), prefix+"*"))
}

func mounted(root, prefix string, need int64) (*Dir, error) {
	avail := proc.AvailableMemory()
	if avail <= 0 {
		return nil, errors.New("the memory available is unknown")
	}
	// A tmpfs takes memory only as it is written: its size is the most it
	// may take, so that an estimate short of the copy cannot fail it.
	size := avail / 4 * 3
	if need+need/64 > size {
		return nil, fmt.Errorf("the copy (%d bytes) would take more than three quarters of the %d bytes of memory available", need, avail)
	}
	parent, err := fsat.MkdirOwned(root)
	if err != nil {
		return nil, err
	}
	sweep(parent, prefix)
	d, err := mkdir(parent, prefix)
	if err != nil {
		parent.Close()
		return nil, err
	}
	m, err := mount(d.dir, size)
	if err == nil {
		d.mntID, err = mountID(m)
		if err != nil {
			unix.Unmount(procFD(m), unix.MNT_DETACH)
			m.Close()
		}
	}
	if err != nil {
		d.Remove()
		return nil, fmt.Errorf("mount a tmpfs on %s: %w", d.Path, err)
	}
	d.dir.Close()
	d.dir, d.Mounted = m, true
	return d, nil
}

// mountID is the id of the mount whose root f is.
func mountID(f *os.File) (uint64, error) {
	var st unix.Statx_t
	if err := unix.Statx(int(f.Fd()), "", unix.AT_EMPTY_PATH, unix.STATX_MNT_ID, &st); err != nil {
		return 0, fmt.Errorf("statx %s: %w", f.Name(), err)
	}
	if st.Mask&unix.STATX_MNT_ID == 0 || st.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return 0, fmt.Errorf("statx %s: the kernel does not say the mount", f.Name())
	}
	if st.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return 0, fmt.Errorf("%s is not the root of a mount", f.Name())
	}
	return st.Mnt_id, nil
}

// procFD names f's own file (a mount's root: that mount, whatever became
// of its path) for the calls that take only a path.
func procFD(f *os.File) string { return "/proc/self/fd/" + strconv.Itoa(int(f.Fd())) }

// unmount detaches the mount whose root m is, if its id is id.
func unmount(m *os.File, id uint64) error {
	got, err := mountID(m)
	if err != nil {
		return err
	}
	if got != id {
		return fmt.Errorf("%s: mount %d, not the mount %d made for it", m.Name(), got, id)
	}
	// Detached: a descriptor still open somewhere does not hold it up.
	if err := unix.Unmount(procFD(m), unix.MNT_DETACH); err != nil {
		return fmt.Errorf("unmount the tmpfs %s: %w", m.Name(), err)
	}
	return nil
}

// Remove drops the copy: its files, the mount, the directory.
func (d *Dir) Remove() error {
	if d == nil || d.dir == nil {
		return nil
	}
	// The files first: their memory goes even if the unmount fails.
	err := fsat.Empty(d.dir)
	if d.Mounted {
		if uerr := unmount(d.dir, d.mntID); uerr != nil {
			return errors.Join(err, uerr)
		}
		d.Mounted = false
	}
	d.dir.Close()
	d.dir = nil
	if rerr := unix.Unlinkat(int(d.parent.Fd()), d.name, unix.AT_REMOVEDIR); rerr != nil && !errors.Is(rerr, unix.ENOENT) && err == nil {
		err = rerr
	}
	d.parent.Close()
	if err != nil {
		return fmt.Errorf("remove %s: %w", d.Path, err)
	}
	return nil
}

// staleAfter is how long an empty mount must have been untouched before
// sweep takes it: a run that just mounted its own creates its files at once.
var staleAfter = 10 * time.Minute

// sweep unmounts and removes what runs killed before their Remove left
// under root: directories named prefix* that are the root of one of our
// tmpfs mounts (by its id in mountinfo), empty, and untouched for
// staleAfter. Anything else is left alone.
func sweep(root *os.File, prefix string) {
	names, _ := fsat.Names(root)
	ours := ourMounts()
	for _, name := range names {
		if !strings.HasPrefix(name, prefix) {
			continue
		}
		d, err := fsat.OpenDir(root, name)
		if err != nil {
			continue
		}
		id, err := mountID(d)
		var st unix.Stat_t
		stale := err == nil && ours[id] && unix.Fstat(int(d.Fd()), &st) == nil && time.Since(time.Unix(st.Mtim.Unix())) >= staleAfter
		if sub, err := fsat.Names(d); !stale || err != nil || len(sub) != 0 {
			d.Close()
			continue
		}
		if unmount(d, id) == nil {
			unix.Unlinkat(int(root.Fd()), name, unix.AT_REMOVEDIR)
		}
		d.Close()
	}
}

// ourMounts are the ids of the tmpfs mounts made by New (its source name).
func ourMounts() map[uint64]bool {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	ids := map[uint64]bool{}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		_, rest, ok := strings.Cut(l, " - ")
		r := strings.Fields(rest)
		if !ok || len(f) < 1 || len(r) < 2 || r[0] != "tmpfs" || r[1] != source {
			continue
		}
		if id, err := strconv.ParseUint(f[0], 10, 64); err == nil {
			ids[id] = true
		}
	}
	return ids
}
