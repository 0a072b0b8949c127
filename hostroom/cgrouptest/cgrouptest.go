// Package cgrouptest makes real memory cgroups for tests: a child of the
// hierarchy's root with a memory limit, on cgroup v2 where the host has
// its memory controller, else v1. Tests of what happens under a memory
// limit (the fast path's room check) run processes in one.
package cgrouptest

import (
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
	name := fmt.Sprintf("gpucr-test-%d-%s", os.Getpid(), strings.ReplaceAll(t.Name(), "/", "-"))
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

// remove kills what is left in the cgroup and removes it.
func (c *Cgroup) remove() {
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
