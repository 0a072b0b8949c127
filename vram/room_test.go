package vram

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/hostroom/cgrouptest"
	"golang.org/x/sys/unix"
)

// TestKeptCopyRoom (issue 36): the kept copy is host memory charged to the
// cgroup of the process whose copy threads write it. Under a memory limit
// smaller than what the process wrote, the checkpoint refuses before it
// releases anything, says how much it needs and has, and the process runs
// on with its memory (without the check the copy out would get it
// OOM-killed). Under a limit that leaves room, the round trip holds.
func TestKeptCopyRoom(t *testing.T) {
	ctx := context.Background()
	tg := startTarget(t, "FP_EXTRA_MB=96")
	cg := cgrouptest.New(t, 32<<20)
	cg.Move(tg.pid)
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
	if !errors.Is(err, errdefs.ErrNoRoom) || !strings.Contains(err.Error(), cg.Dir) || !strings.Contains(err.Error(), "refused before any device memory was released") {
		t.Fatalf("checkpoint under a limit of 32 MiB: %v, want refused for want of room in %s", err, cg.Dir)
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
	cg.SetLimit(1 << 30)
	tg.mustBeIntact(t)
	if n := cg.OOMKills(); n != 0 {
		t.Fatalf("%d OOM kills in %s", n, cg.Dir)
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
