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
// Where it cannot (not root, no tmpfs, or the copy would take more than
// three quarters of the memory available, since a tmpfs lives in memory),
// the copy goes into $TMPDIR. A directory the user names is used as it is.
// A copy that must outlive the process that made it (a gpucr-stream killed
// meanwhile; a migration whose receiver failed) stays in its mount; Remove
// takes both away. Mounts that such a run left behind, once emptied (the
// library refilled from the kept copy and removed it; the user removed a
// kept image) and untouched for a while, are unmounted by the next New.
package scratch

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/proc"
	"golang.org/x/sys/unix"
)

// Dir is a directory for a copy held until a commit.
type Dir struct {
	Path string
	// Mounted: Path is a tmpfs of its own (huge pages), unmounted by
	// Remove. Else Why says why not (empty when the user chose the dir).
	Mounted bool
	Why     string
}

// mount mounts a tmpfs of size bytes on dir; a variable so that tests can
// refuse.
var mount = func(dir string, size int64) error {
	return unix.Mount("gpucr-scratch", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC,
		"mode=0700,huge=always,size="+strconv.FormatInt(size, 10))
}

// New makes a directory named prefix* for a copy of about need bytes (an
// estimate will do: it only decides whether memory can hold it): in
// base when given, else on a tmpfs of its own under root when it can, else
// in $TMPDIR.
func New(root, base, prefix string, need int64) (*Dir, error) {
	if base != "" {
		d, err := os.MkdirTemp(base, prefix)
		if err != nil {
			return nil, fmt.Errorf("scratch directory: %w", err)
		}
		return &Dir{Path: d}, nil
	}
	d, err := mounted(root, prefix, need)
	if err == nil {
		return d, nil
	}
	p, err2 := os.MkdirTemp("", prefix)
	if err2 != nil {
		return nil, fmt.Errorf("scratch directory: %w (a tmpfs of its own: %v)", err2, err)
	}
	return &Dir{Path: p, Why: err.Error()}, nil
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
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, err
	}
	sweep(root, prefix)
	d, err := os.MkdirTemp(root, prefix)
	if err != nil {
		return nil, err
	}
	if err := mount(d, size); err != nil {
		os.Remove(d)
		return nil, fmt.Errorf("mount a tmpfs on %s: %w", d, err)
	}
	return &Dir{Path: d, Mounted: true}, nil
}

// Remove drops the copy: its files, the mount, the directory.
func (d *Dir) Remove() error {
	if d == nil {
		return nil
	}
	if !d.Mounted {
		if err := os.RemoveAll(d.Path); err != nil {
			return fmt.Errorf("remove %s: %w", d.Path, err)
		}
		return nil
	}
	// The files first: their memory goes even if the unmount fails.
	ents, err := os.ReadDir(d.Path)
	for _, e := range ents {
		if rerr := os.RemoveAll(filepath.Join(d.Path, e.Name())); rerr != nil && err == nil {
			err = rerr
		}
	}
	// Detached: a descriptor still open somewhere does not hold it up.
	if uerr := unix.Unmount(d.Path, unix.MNT_DETACH); uerr != nil {
		return errors.Join(err, fmt.Errorf("unmount the tmpfs %s: %w", d.Path, uerr))
	}
	d.Mounted = false
	if rerr := os.Remove(d.Path); rerr != nil && err == nil {
		err = rerr
	}
	if err != nil {
		return fmt.Errorf("remove %s: %w", d.Path, err)
	}
	return nil
}

// staleAfter is how long an empty mount must have been untouched before
// sweep takes it: a run that just mounted its own creates its files at once.
var staleAfter = 10 * time.Minute

// sweep unmounts and removes what runs killed before their Remove left
// under root: directories named prefix* that are mount points, empty, and
// untouched for staleAfter. Anything else is left alone.
func sweep(root, prefix string) {
	var rst unix.Stat_t
	if unix.Stat(root, &rst) != nil {
		return
	}
	ents, _ := os.ReadDir(root)
	for _, e := range ents {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), prefix) {
			continue
		}
		p := filepath.Join(root, e.Name())
		var st unix.Stat_t
		if unix.Stat(p, &st) != nil || st.Dev == rst.Dev { // not a mount point
			continue
		}
		if time.Since(time.Unix(st.Mtim.Unix())) < staleAfter {
			continue
		}
		if sub, err := os.ReadDir(p); err != nil || len(sub) != 0 {
			continue
		}
		if unix.Unmount(p, unix.MNT_DETACH) == nil {
			os.Remove(p)
		}
	}
}
