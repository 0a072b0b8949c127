// Package cgrouptest makes real cgroups for tests: memory cgroups, a
// child of the hierarchy's root with a memory limit, on cgroup v2 where
// the host has its memory controller, else v1 (tests of what happens
// under a memory limit: the fast path's room check); and plain cgroup v2
// ones, on the unified hierarchy of a hybrid host too (tests of its
// freezer: swrk's freeze ahead of CRIU).
package cgrouptest

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Cgroup is a memory cgroup a test made; it is removed (its processes
// killed) when the test ends.
type Cgroup struct {
	t *testing.T
	// Dir is its directory.
	Dir       string
	limitFile string
}

// New makes a memory cgroup with the given limit. It needs root; without a
// memory controller it skips the test, or fails it with CI=true.
func New(t *testing.T, limit int64) *Cgroup {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI runs the tests as root")
		}
		t.Skip("needs root")
	}
	name := name(t)
	c := &Cgroup{t: t}
	if b, err := os.ReadFile("/sys/fs/cgroup/cgroup.controllers"); err == nil && strings.Contains(string(b), "memory") {
		// Children get the controller only where the parent hands it down.
		_ = os.WriteFile("/sys/fs/cgroup/cgroup.subtree_control", []byte("+memory"), 0)
		c.Dir, c.limitFile = filepath.Join("/sys/fs/cgroup", name), "memory.max"
	} else if _, err := os.Stat("/sys/fs/cgroup/memory/memory.limit_in_bytes"); err == nil {
		c.Dir, c.limitFile = filepath.Join("/sys/fs/cgroup/memory", name), "memory.limit_in_bytes"
	} else {
		if os.Getenv("CI") == "true" {
			t.Fatal("no memory cgroup controller (v2 or v1): CI must test under a memory limit")
		}
		t.Skip("no memory cgroup controller")
	}
	if err := os.Mkdir(c.Dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.remove)
	c.SetLimit(limit)
	return c
}

// V2 makes a cgroup v2, a child of the first cgroup2 mount, with no
// controllers. It needs root and a cgroup2 mount; without them it skips
// the test, or fails it with CI=true.
func V2(t *testing.T) *Cgroup {
	t.Helper()
	mnt := cgroup2Mount()
	if os.Geteuid() != 0 || mnt == "" {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI runs the tests as root on a host with a cgroup2 mount (euid %d, mount %q)", os.Geteuid(), mnt)
		}
		t.Skip("needs root and a cgroup2 mount")
	}
	c := &Cgroup{t: t, Dir: filepath.Join(mnt, name(t))}
	if err := os.Mkdir(c.Dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.remove)
	return c
}

// name is a cgroup name of the test's own.
func name(t *testing.T) string {
	return fmt.Sprintf("gpucr-test-%d-%s", os.Getpid(), strings.ReplaceAll(t.Name(), "/", "-"))
}

// cgroup2Mount is where the first cgroup2 file system is mounted, or "".
func cgroup2Mount() string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS... - FSTYPE SOURCE SUPER
		fields := strings.Fields(sc.Text())
		for i, f := range fields {
			if f == "-" && i+1 < len(fields) && fields[i+1] == "cgroup2" && len(fields) > 4 {
				return fields[4]
			}
		}
	}
	return ""
}

// remove kills what is left in the cgroup and removes it.
func (c *Cgroup) remove() {
	_ = os.WriteFile(filepath.Join(c.Dir, "cgroup.freeze"), []byte("0"), 0) // v2, frozen by the test
	for range 500 {
		if err := unix.Rmdir(c.Dir); err == nil || errors.Is(err, unix.ENOENT) {
			return
		}
		procs, _ := os.ReadFile(filepath.Join(c.Dir, "cgroup.procs"))
		for _, p := range strings.Fields(string(procs)) {
			if pid, err := strconv.Atoi(p); err == nil {
				unix.Kill(pid, unix.SIGKILL)
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	c.t.Errorf("cgroup %s not removed", c.Dir)
}

// SetLimit sets its memory limit.
func (c *Cgroup) SetLimit(n int64) {
	c.t.Helper()
	if err := os.WriteFile(filepath.Join(c.Dir, c.limitFile), []byte(strconv.FormatInt(n, 10)), 0); err != nil {
		c.t.Fatal(err)
	}
}

// Move puts process pid into it.
func (c *Cgroup) Move(pid int) {
	c.t.Helper()
	if err := os.WriteFile(filepath.Join(c.Dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
		c.t.Fatal(err)
	}
}

// OOMKills is the OOM kills it saw (v2 memory.events, v1
// memory.oom_control).
func (c *Cgroup) OOMKills() int {
	c.t.Helper()
	for _, f := range []string{"memory.events", "memory.oom_control"} {
		b, err := os.ReadFile(filepath.Join(c.Dir, f))
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "oom_kill "); ok {
				n, _ := strconv.Atoi(strings.TrimSpace(v))
				return n
			}
		}
	}
	c.t.Fatalf("%s: no OOM kill count", c.Dir)
	return 0
}
