package cudadriver

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/gpucr/gpucr-stream/proc"
)

// Usage says how a process uses CUDA, as far as /proc shows.
type Usage struct {
	PID int
	// MapsLibcuda: libcuda.so is mapped (CUDA was loaded; stays true while
	// the process is checkpointed).
	MapsLibcuda bool
	// DeviceFDs: open descriptors on /dev/nvidia* (the GPU is in use; none
	// while checkpointed).
	DeviceFDs int
}

// IsCUDA says whether the process uses (or used) the CUDA driver.
func (u Usage) IsCUDA() bool { return u.MapsLibcuda || u.DeviceFDs > 0 }

// Inspect reads one process's CUDA usage from /proc.
func Inspect(pid int) Usage {
	u := Usage{PID: pid}
	dir := filepath.Join(proc.Root, strconv.Itoa(pid))
	if f, err := os.Open(filepath.Join(dir, "maps")); err == nil {
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Bytes()
			if i := bytes.LastIndexByte(line, '/'); i >= 0 && bytes.HasPrefix(line[i+1:], []byte("libcuda.so")) {
				u.MapsLibcuda = true
				break
			}
		}
		f.Close()
	}
	fds, _ := os.ReadDir(filepath.Join(dir, "fd"))
	for _, fd := range fds {
		target, err := os.Readlink(filepath.Join(dir, "fd", fd.Name()))
		if err == nil && strings.HasPrefix(target, "/dev/nvidia") {
			u.DeviceFDs++
		}
	}
	return u
}

// FindCUDA returns the processes of root's tree that use CUDA, in tree
// order (root first), and the whole tree.
func FindCUDA(root int) (cuda []Usage, tree []int, err error) {
	tree, err = proc.Tree(root)
	if err != nil {
		return nil, nil, err
	}
	for _, pid := range tree {
		if u := Inspect(pid); u.IsCUDA() {
			cuda = append(cuda, u)
		}
	}
	return cuda, tree, nil
}

// PIDs lists the pids of us.
func PIDs(us []Usage) []int {
	out := make([]int, len(us))
	for i, u := range us {
		out[i] = u.PID
	}
	return out
}
