// Package hostroom says how much room this host has for a copy held in it:
// the memory the kernel can give (MemAvailable), the headroom under the
// memory limits of the cgroups that will be charged for the copy's pages
// (cgroup v2, else v1), and the free space of a file system. The fast
// path's kept copy asks it before any device memory is released
// (vram/room.go): a tmpfs page is charged to the memory cgroup of the
// process that writes it, and a cgroup over its limit is OOM-killed.
package hostroom

import (
	"bufio"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/gpucr/gpucr-stream/proc"
	"golang.org/x/sys/unix"
)

// Cgroup is one memory cgroup: where it is, its limit and what it holds
// that cannot be reclaimed (its usage less its inactive file pages).
type Cgroup struct {
	// Path is the cgroup's directory (under the cgroup mount).
	Path string
	// V1: the legacy memory controller (memory.limit_in_bytes).
	V1 bool
	// Limit is its memory limit (0: none); Used, what it holds.
	Limit, Used int64
}

// Headroom is what the cgroup can still take (0 when over its limit); -1
// when it has no limit.
func (c Cgroup) Headroom() int64 {
	if c.Limit <= 0 {
		return -1
	}
	return max(0, c.Limit-c.Used)
}

func (c Cgroup) String() string {
	file := "memory.max"
	if c.V1 {
		file = "memory.limit_in_bytes"
	}
	return fmt.Sprintf("cgroup %s (%s %d, %d in use)", c.Path, file, c.Limit, c.Used)
}

// Cgroups are the memory cgroups pid's pages are charged to: its own and
// every one above it, with a limit or not, innermost first. None when the
// host has no memory controller.
func Cgroups(pid int) ([]Cgroup, error) {
	dir, v1, root, err := cgroupDir(pid)
	if err != nil || dir == "" {
		return nil, err
	}
	var cs []Cgroup
	for d := dir; ; d = filepath.Dir(d) {
		c, err := readCgroup(d, v1, d == root)
		if err != nil {
			return nil, fmt.Errorf("process %d: memory cgroup %s: %w", pid, d, err)
		}
		cs = append(cs, c)
		if d == root || len(d) <= len(root) {
			return cs, nil
		}
	}
}

// cgroupDir is pid's memory cgroup directory and the mount it is under
// ("" when the host has no memory controller).
func cgroupDir(pid int) (dir string, v1 bool, mnt string, err error) {
	b, err := os.ReadFile(filepath.Join(proc.Root, strconv.Itoa(pid), "cgroup"))
	if err != nil {
		return "", false, "", fmt.Errorf("process %d: %w", pid, err)
	}
	ms, err := cgroupMounts()
	if err != nil {
		return "", false, "", err
	}
	var v2path string
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(l, ":", 3)
		if len(f) != 3 {
			continue
		}
		if f[0] == "0" && f[1] == "" {
			v2path = f[2]
		} else if hasOption(f[1], "memory") && ms.v1.point != "" {
			return ms.v1.under(f[2]), true, ms.v1.point, nil
		}
	}
	if ms.v2.point != "" && v2path != "" && hasMemory(ms.v2.point) {
		return ms.v2.under(v2path), false, ms.v2.point, nil
	}
	return "", false, "", nil
}

// mount is a cgroup mount: where, and which cgroup is its root (one below
// the hierarchy's in a container).
type mount struct{ point, root string }

// under is a cgroup path of /proc/PID/cgroup as a directory of m.
func (m mount) under(path string) string {
	rel := path
	if m.root != "/" {
		rel = strings.TrimPrefix(path, m.root)
	}
	return filepath.Join(m.point, rel)
}

// cgroupMounts finds this mount namespace's cgroup2 mount and the v1 mount
// of the memory controller (/proc/self/mountinfo); a point "" is none.
func cgroupMounts() (ms struct{ v1, v2 mount }, err error) {
	f, err := os.Open(filepath.Join(proc.Root, "self", "mountinfo"))
	if err != nil {
		return ms, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		a, b := strings.Fields(pre), strings.Fields(post)
		if !ok || len(a) < 5 || len(b) < 3 {
			continue
		}
		m := mount{point: unescape(a[4]), root: unescape(a[3])}
		switch {
		case b[0] == "cgroup2" && ms.v2.point == "":
			ms.v2 = m
		case b[0] == "cgroup" && ms.v1.point == "" && hasOption(b[2], "memory"):
			ms.v1 = m
		}
	}
	return ms, sc.Err()
}

func hasOption(opts, want string) bool {
	for _, o := range strings.Split(opts, ",") {
		if o == want {
			return true
		}
	}
	return false
}

// unescape undoes mountinfo's octal escapes (\040 for a space).
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// hasMemory says whether the cgroup2 hierarchy at mnt has the memory
// controller (else a host on cgroup v1 for memory, or none).
func hasMemory(mnt string) bool {
	b, err := os.ReadFile(filepath.Join(mnt, "cgroup.controllers"))
	return err == nil && hasOption(strings.ReplaceAll(strings.TrimSpace(string(b)), " ", ","), "memory")
}

// readCgroup reads the limit and use of the cgroup at dir (top: the
// hierarchy's root, which on v2 has no limit files).
func readCgroup(dir string, v1, top bool) (Cgroup, error) {
	c := Cgroup{Path: dir, V1: v1}
	limitFile, usageFile, inactive := "memory.max", "memory.current", "inactive_file"
	if v1 {
		limitFile, usageFile, inactive = "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
	}
	lim, err := readInt(filepath.Join(dir, limitFile))
	if errors.Is(err, os.ErrNotExist) && !v1 && top {
		return c, nil
	}
	if err != nil {
		return c, err
	}
	// v1 says no limit with a page-rounded 2^63-1.
	if lim > 0 && lim < 1<<62 {
		c.Limit = lim
	}
	used, err := readInt(filepath.Join(dir, usageFile))
	if err != nil {
		return c, err
	}
	// Inactive file pages are reclaimed before the cgroup is OOM-killed.
	c.Used = max(0, used-statField(filepath.Join(dir, "memory.stat"), inactive))
	return c, nil
}

// readInt reads a cgroup file of one number ("max": -1).
func readInt(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return -1, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%s: %q: %w", path, s, err)
	}
	return n, nil
}

// statField is the value of key in a memory.stat file (0 if absent).
func statField(path, key string) int64 {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, key+" "); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n
		}
	}
	return 0
}

// FS is the room of the file system a directory is on.
type FS struct {
	// Free is what an unprivileged writer may still write.
	Free int64
	// Memory: the file system lives in memory (tmpfs, ramfs): its pages
	// are the memory of the cgroup that writes them.
	Memory bool
}

// FSOf says how much room the file system of dir has.
func FSOf(dir *os.File) (FS, error) {
	var st unix.Statfs_t
	if err := unix.Fstatfs(int(dir.Fd()), &st); err != nil {
		return FS{}, fmt.Errorf("statfs %s: %w", dir.Name(), err)
	}
	return FS{Free: int64(st.Bavail) * st.Bsize, Memory: st.Type == unix.TMPFS_MAGIC || st.Type == unix.RAMFS_MAGIC}, nil
}

// Available is MemAvailable (0 when unknown).
func Available() int64 { return proc.AvailableMemory() }

// Shortfall says where host memory charged to processes would not fit:
// need is the bytes each process (by pid) will be charged. short is false
// when MemAvailable and the headroom of every memory cgroup the processes
// are charged to (each cgroup counts all of its processes' bytes) cover
// it; else have is what that place has and where names it. A cgroup that
// cannot be read is not checked; an unknown MemAvailable neither.
func Shortfall(need map[int]int64) (have int64, where string, short bool) {
	var total int64
	for _, n := range need {
		total += n
	}
	if avail := Available(); avail > 0 && avail < total {
		return avail, "the host's memory (MemAvailable)", true
	}
	per, cgs := map[string]int64{}, map[string]Cgroup{}
	for pid, n := range need {
		cs, err := Cgroups(pid)
		if err != nil {
			continue
		}
		for _, c := range cs {
			per[c.Path] += n
			cgs[c.Path] = c
		}
	}
	for _, path := range slices.Sorted(maps.Keys(per)) {
		if h := cgs[path].Headroom(); h >= 0 && h < per[path] {
			return h, cgs[path].String(), true
		}
	}
	return 0, "", false
}

// Bytes is n for a message: MiB below a GiB, else GiB.
func Bytes(n int64) string {
	if n < 1<<30 {
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	}
	return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
}
