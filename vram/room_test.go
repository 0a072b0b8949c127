package vram

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"golang.org/x/sys/unix"
)

// memoryCgroup makes a child memory cgroup for a test, with the given
// limit, on cgroup v2 where the host has its memory controller, else v1,
// and removes it at the end; move puts a process into it. With CI=true a
// host without either fails the test.
func memoryCgroup(t *testing.T, limit int64) (dir string, setLimit func(int64), move func(pid int)) {
	t.Helper()
	mustRoot(t)
	name := fmt.Sprintf("gpucr-test-%d-%s", os.Getpid(), strings.ReplaceAll(t.Name(), "/", "-"))
	limitFile := ""
	if b, err := os.ReadFile("/sys/fs/cgroup/cgroup.controllers"); err == nil && strings.Contains(string(b), "memory") {
		// Children get the controller only where the parent hands it down.
		os.WriteFile("/sys/fs/cgroup/cgroup.subtree_control", []byte("+memory"), 0)
		dir, limitFile = filepath.Join("/sys/fs/cgroup", name), "memory.max"
	} else if _, err := os.Stat("/sys/fs/cgroup/memory/memory.limit_in_bytes"); err == nil {
		dir, limitFile = filepath.Join("/sys/fs/cgroup/memory", name), "memory.limit_in_bytes"
	} else {
		if os.Getenv("CI") == "true" {
			t.Fatal("no memory cgroup controller (v2 or v1): CI must test the refusal under a memory limit")
		}
		t.Skip("no memory cgroup controller")
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Its processes are killed by the targets' cleanups; wait for them
		// to leave.
		for range 500 {
			if err := unix.Rmdir(dir); err == nil || errors.Is(err, unix.ENOENT) {
				return
			}
			procs, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
			for _, p := range strings.Fields(string(procs)) {
				if pid, err := strconv.Atoi(p); err == nil {
					unix.Kill(pid, unix.SIGKILL)
				}
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Errorf("cgroup %s not removed", dir)
	})
	setLimit = func(n int64) {
		if err := os.WriteFile(filepath.Join(dir, limitFile), []byte(strconv.FormatInt(n, 10)), 0); err != nil {
			t.Fatal(err)
		}
	}
	setLimit(limit)
	move = func(pid int) {
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			t.Fatal(err)
		}
	}
	return dir, setLimit, move
}

// TestKeptCopyRoom (issue 36): the kept copy is host memory charged to the
// cgroup of the process whose copy threads write it. Under a memory limit
// smaller than what the process wrote, the checkpoint refuses before it
// releases anything, says how much it needs and has, and the process runs
// on with its memory (without the check the copy out would get it
// OOM-killed). Under a limit that leaves room, the round trip holds.
func TestKeptCopyRoom(t *testing.T) {
	ctx := context.Background()
	tg := startTarget(t, "FP_EXTRA_MB=96")
	dir, setLimit, move := memoryCgroup(t, 32<<20)
	move(tg.pid)
	o := fastOpts(tg, t)
	// The kept copy on a tmpfs (as scratch mounts one): in memory.
	if err := os.MkdirAll(o.KeepDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("keep", o.KeepDir, "tmpfs", 0, "size=1g,mode=0700"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(o.KeepDir, unix.MNT_DETACH) })
	used := tg.report(t).DeviceUsed
	_, err := FastSuspend(ctx, []int{tg.pid}, newStore().put, o)
	if !errors.Is(err, errdefs.ErrNoRoom) || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), "refused before any device memory was released") {
		t.Fatalf("checkpoint under a limit of 32 MiB: %v, want refused for want of room in %s", err, dir)
	}
	if r := tg.report(t); r.Parked || r.Released || r.DeviceUsed != used {
		t.Fatalf("after the refusal: %+v", r)
	}
	if ents, _ := os.ReadDir(o.KeepDir); len(ents) != 0 {
		t.Fatalf("a refused checkpoint wrote %d kept files", len(ents))
	}
	// Room enough (the target's own check reads its memory into buffers
	// of its own, which the small limit would not hold either): it runs
	// on intact, never OOM-killed, and the copy, charged to the cgroup,
	// fits.
	setLimit(1 << 30)
	tg.mustBeIntact(t)
	if n := oomKills(t, dir); n != 0 {
		t.Fatalf("%d OOM kills in %s", n, dir)
	}
	st := newStore()
	s, err := FastSuspend(ctx, []int{tg.pid}, st.put, o)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	s.Commit()
	if _, _, _, err := FastResume(ctx, tg.sockDir, tg.pid, s.Procs()[0].Files, st.get, nil); err != nil {
		t.Fatal(err)
	}
	tg.mustBeIntact(t)
}

// oomKills is the OOM kills a memory cgroup saw (v2 memory.events, v1
// memory.oom_control).
func oomKills(t *testing.T, dir string) int {
	t.Helper()
	for _, f := range []string{"memory.events", "memory.oom_control"} {
		b, err := os.ReadFile(filepath.Join(dir, f))
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
	t.Fatalf("%s: no OOM kill count", dir)
	return 0
}
