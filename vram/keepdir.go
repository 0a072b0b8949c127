package vram

// The kept copy's directory. The copy threads write the whole of a
// process's device memory into it, so how its pages are allocated bounds
// the copy out: on an H100 host 16 writers filled a tmpfs of small pages
// at 14.5 to 31.5 GB/s and one mounted with huge=always at 39.5 to
// 47.5 GB/s (the copy out of 13.2 GB: 0.82 s against 0.46 s). No host
// setting gives /dev/shm or a memfd huge pages, but a tmpfs of our own can
// ask for them. So by default each fast-path checkpoint mounts one, sized
// for the copy, in a directory of its own (under the library's socket
// directory, root only), and unmounts it when the copy is dropped.
//
// Where it cannot (not root, no tmpfs, or the copy would take more than
// three quarters of the memory available, since a tmpfs lives in memory),
// the copy goes into $TMPDIR as before. A directory the user names is used
// as it is. A gpucr-stream killed meanwhile leaves the mount with the kept
// files in it: the library refills from them, or `gpu resume --pid` does,
// and removes them; the empty mount stays until unmounted.

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// KeepDir is where a checkpoint's copy of device memory is kept until its
// commit.
type KeepDir struct {
	Path string
	// Mounted: Path is a tmpfs of its own (huge pages), unmounted by
	// Remove. Else Why says why not (empty when the user chose the dir).
	Mounted bool
	Why     string
}

// mountKeep mounts a tmpfs on dir; a variable so that tests can refuse.
var mountKeep = func(dir string, size int64) error {
	return unix.Mount("gpucr-vram-keep", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC,
		"mode=0700,huge=always,size="+strconv.FormatInt(size, 10))
}

// NewKeepDir makes the directory for a kept copy of need bytes: in base
// when given, else on a tmpfs of its own when it can, else in $TMPDIR.
func NewKeepDir(base string, need int64) (*KeepDir, error) {
	if base != "" {
		d, err := os.MkdirTemp(base, "gpucr-vram-keep-")
		if err != nil {
			return nil, fmt.Errorf("kept copy: %w", err)
		}
		return &KeepDir{Path: d}, nil
	}
	k, err := mountedKeepDir(need)
	if err == nil {
		return k, nil
	}
	d, err2 := os.MkdirTemp("", "gpucr-vram-keep-")
	if err2 != nil {
		return nil, fmt.Errorf("kept copy: %w (a tmpfs of its own: %v)", err2, err)
	}
	return &KeepDir{Path: d, Why: err.Error()}, nil
}

func mountedKeepDir(need int64) (*KeepDir, error) {
	avail, err := memAvailable()
	if err != nil {
		return nil, err
	}
	// Room for the files' headers and the page rounding of each file.
	size := need + need/64 + 64<<20
	if size > avail/4*3 {
		return nil, fmt.Errorf("the kept copy (%d bytes) would take more than three quarters of the %d bytes of memory available", need, avail)
	}
	root := PreloadDir()
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, err
	}
	d, err := os.MkdirTemp(root, "vram-keep-")
	if err != nil {
		return nil, err
	}
	if err := mountKeep(d, size); err != nil {
		os.Remove(d)
		return nil, fmt.Errorf("mount a tmpfs on %s: %w", d, err)
	}
	return &KeepDir{Path: d, Mounted: true}, nil
}

// Remove drops the kept copy: its files, the mount, the directory.
func (k *KeepDir) Remove() error {
	if k == nil {
		return nil
	}
	if !k.Mounted {
		if err := os.RemoveAll(k.Path); err != nil {
			return fmt.Errorf("remove the kept copy %s: %w", k.Path, err)
		}
		return nil
	}
	// The files first: their memory goes even if the unmount fails.
	ents, err := os.ReadDir(k.Path)
	for _, e := range ents {
		if rerr := os.RemoveAll(filepath.Join(k.Path, e.Name())); rerr != nil && err == nil {
			err = rerr
		}
	}
	// Detached: a descriptor still open somewhere does not hold it up.
	if uerr := unix.Unmount(k.Path, unix.MNT_DETACH); uerr != nil {
		return errors.Join(err, fmt.Errorf("unmount the kept copy's tmpfs %s: %w", k.Path, uerr))
	}
	k.Mounted = false
	if rerr := os.Remove(k.Path); rerr != nil && err == nil {
		err = rerr
	}
	if err != nil {
		return fmt.Errorf("remove the kept copy %s: %w", k.Path, err)
	}
	return nil
}

// memAvailable is MemAvailable of /proc/meminfo, in bytes.
func memAvailable() (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "MemAvailable:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("%s: MemAvailable %q: %w", filepath.Base(f.Name()), rest, err)
			}
			return kb << 10, nil
		}
	}
	return 0, errors.New("/proc/meminfo: no MemAvailable")
}
