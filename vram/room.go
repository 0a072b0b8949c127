package vram

// Room for the kept copy (issue 36): the copy out writes what the
// processes wrote into the kept copy's directory, by default a tmpfs,
// whose pages are host memory charged to the memory cgroup of the process
// that writes them (the library's copy threads run in the GPU process). A
// copy that does not fit would fail on a full file system at best, and
// get the GPU process OOM-killed at worst, so it is refused before it
// begins: nothing is released, the processes run on.

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/hostroom"
)

// checkRoom says whether keep (the kept copy's directory) can take need
// bytes from each process (by pid): the free space of its file system,
// and where that lives in memory, MemAvailable and the headroom of every
// memory cgroup the writers' pages are charged to. A cgroup that cannot
// be read is not checked.
func checkRoom(keep *os.File, need map[int]int64) error {
	var total int64
	for _, n := range need {
		total += n
	}
	fs, err := hostroom.FSOf(keep)
	if err != nil {
		return fmt.Errorf("fast path: room for the kept copy: %w", err)
	}
	refuse := func(have int64, where string) error {
		msg := fmt.Sprintf("fast path: the kept copy of the device memory the processes wrote needs %s, and %s has %s: refused before any device memory was released, the processes run on",
			hostroom.Bytes(total), where, hostroom.Bytes(have))
		if fs.Memory {
			if d, free := diskWithRoom(total); d != "" {
				msg += fmt.Sprintf("; --vram-keep-dir on a local disk would do (%s has %s free)", d, hostroom.Bytes(free))
			} else {
				msg += "; --vram-keep-dir on a local disk with that much free would do"
			}
		}
		return fmt.Errorf("%s: %w", msg, errdefs.ErrNoRoom)
	}
	if fs.Free < total {
		return refuse(fs.Free, "the file system of "+keep.Name())
	}
	if !fs.Memory {
		return nil
	}
	if have, where, short := hostroom.Shortfall(need); short {
		return refuse(have, where)
	}
	return nil
}

// diskWithRoom is a directory on a local disk (not in memory) with room
// for n bytes, and its free space: $TMPDIR or /var/tmp.
func diskWithRoom(n int64) (string, int64) {
	for _, d := range []string{os.TempDir(), "/var/tmp"} {
		f, err := os.Open(filepath.Clean(d))
		if err != nil {
			continue
		}
		fs, err := hostroom.FSOf(f)
		f.Close()
		if err == nil && !fs.Memory && fs.Free >= n {
			return d, fs.Free
		}
	}
	return "", 0
}
