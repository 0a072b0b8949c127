package vram

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// ProcRoot is where /proc is read (tests point it at a fake tree).
var ProcRoot = "/proc"

// Tree returns root and its descendants, root first, then in breadth-first
// order. Children are read from /proc/PID/task/*/children (a process forks
// from any of its threads); where the kernel lacks that file, from the
// parent field of every /proc/PID/stat.
func Tree(root int) ([]int, error) {
	if _, err := os.Stat(filepath.Join(ProcRoot, strconv.Itoa(root))); err != nil {
		return nil, fmt.Errorf("process %d: %w", root, err)
	}
	var byParent map[int][]int // built lazily, only without children files
	seen := map[int]bool{root: true}
	out := []int{root}
	for i := 0; i < len(out); i++ {
		kids, ok := childrenOf(out[i])
		if !ok {
			if byParent == nil {
				byParent = parentMap()
			}
			kids = byParent[out[i]]
		}
		for _, k := range kids {
			if !seen[k] {
				seen[k] = true
				out = append(out, k)
			}
		}
	}
	return out, nil
}

// childrenOf reads the children files of every thread of pid; false when
// the kernel does not have them.
func childrenOf(pid int) ([]int, bool) {
	files, _ := filepath.Glob(filepath.Join(ProcRoot, strconv.Itoa(pid), "task", "*", "children"))
	if len(files) == 0 {
		return nil, false
	}
	var kids []int
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, field := range strings.Fields(string(b)) {
			if c, err := strconv.Atoi(field); err == nil {
				kids = append(kids, c)
			}
		}
	}
	sort.Ints(kids)
	return kids, true
}

func parentMap() map[int][]int {
	m := map[int][]int{}
	ents, _ := os.ReadDir(ProcRoot)
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join(ProcRoot, e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces and parentheses.
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(s[i+1:])
		if len(f) < 2 {
			continue
		}
		if pp, err := strconv.Atoi(f[1]); err == nil {
			m[pp] = append(m[pp], pid)
		}
	}
	for _, v := range m {
		sort.Ints(v)
	}
	return m
}

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
	dir := filepath.Join(ProcRoot, strconv.Itoa(pid))
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
	tree, err = Tree(root)
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
