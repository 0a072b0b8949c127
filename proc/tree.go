// Package proc reads what gpucr-stream needs to know of processes from
// /proc: the tree under a PID, whether PIDs are gone, which PID namespace
// this is, and how much memory is available.
package proc

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"

	"github.com/gpucr/gpucr-stream/errdefs"
)

// Root is where /proc is read (tests point it at a fake tree).
var Root = "/proc"

// Tree returns root and its descendants, root first, then in breadth-first
// order. Children are read from /proc/PID/task/*/children (a process forks
// from any of its threads); where the kernel lacks that file, from the
// parent field of every /proc/PID/stat.
func Tree(root int) ([]int, error) {
	if _, err := os.Stat(filepath.Join(Root, strconv.Itoa(root))); err != nil {
		return nil, fmt.Errorf("no process %d: %w", root, errdefs.ErrNotFound)
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
	files, _ := filepath.Glob(filepath.Join(Root, strconv.Itoa(pid), "task", "*", "children"))
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
	ents, _ := os.ReadDir(Root)
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join(Root, e.Name(), "stat"))
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

// Cmdline is the command line of pid, from /proc/PID/cmdline.
func Cmdline(pid int) ([]string, error) {
	b, err := os.ReadFile(filepath.Join(Root, strconv.Itoa(pid), "cmdline"))
	if err != nil {
		return nil, err
	}
	return strings.Split(strings.TrimRight(string(b), "\x00"), "\x00"), nil
}

// NSPID is pid as the process itself sees it: the last of its status's
// NSpid, its PID in the innermost PID namespace it is in (a container's).
// That is the PID CRIU gives it back, where a restore into a new namespace
// (runc restore) gives it a new one here. pid where unknown.
func NSPID(pid int) int {
	if f := StatusField(pid, "NSpid:"); len(f) > 0 {
		if n, err := strconv.Atoi(f[len(f)-1]); err == nil && n > 0 {
			return n
		}
	}
	return pid
}

// StatusField is the fields of the line of /proc/PID/status that starts
// with key ("Uid:"), or nil.
func StatusField(pid int, key string) []string {
	b, err := os.ReadFile(filepath.Join(Root, strconv.Itoa(pid), "status"))
	if err != nil {
		return nil
	}
	for _, l := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(l, key); ok {
			return strings.Fields(rest)
		}
	}
	return nil
}

// DumpEstimate is about the bytes CRIU dumps of the processes pids: their
// anonymous memory (RssAnon of /proc/PID/status), which is nearly all of an
// image. 0 when it cannot be read. The kernel keeps that count, so reading
// it costs the same at any size; smaps_rollup's Anonymous, the same number,
// walks every page table (25 ms a GiB here), in front of every checkpoint.
func DumpEstimate(pids []int) int64 {
	var total int64
	for _, pid := range pids {
		if f := StatusField(pid, "RssAnon:"); len(f) > 0 {
			kb, _ := strconv.ParseInt(f[0], 10, 64)
			total += kb << 10
		}
	}
	return total
}

// KillTree sends SIGKILL to root and every descendant (processes already
// gone are no error).
func KillTree(root int) error {
	tree, err := Tree(root)
	if err != nil {
		return err
	}
	var errs []error
	for _, p := range tree {
		if err := syscall.Kill(p, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
			errs = append(errs, fmt.Errorf("kill %d: %w", p, err))
		}
	}
	return errors.Join(errs...)
}
