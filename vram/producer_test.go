package vram

import (
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/vram/vramtest"
)

// These tests run libgpucr-preload against a fake driver in a test
// program (package vramtest), one command of the library's at a time;
// the fast path's steps in their order, with their undo, are tested in
// package gpuckpt, whose table runs them.

func TestMain(m *testing.M) { vramtest.Run(m) }

// TestPreloadExportsOnlyTheDriver: the library's files share their helpers
// hidden (preload/internal.h), so a program binds to the driver's entry
// points and dlsym in it, and to the two functions it offers programs
// (gpucr_mark_cache, gpucr_unmark_cache), never to another of its names.
func TestPreloadExportsOnlyTheDriver(t *testing.T) {
	f, err := elf.Open(filepath.Join(vramtest.Build(t), preloadctl.Library))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	syms, err := f.DynamicSymbols()
	if err != nil {
		t.Fatal(err)
	}
	driver := regexp.MustCompile(`^(cu[A-Z]\w*|gpucr_(un)?mark_cache|gpucr_fill)$`)
	have := map[string]bool{}
	for _, s := range syms {
		if bind := elf.ST_BIND(s.Info); s.Section == elf.SHN_UNDEF || (bind != elf.STB_GLOBAL && bind != elf.STB_WEAK) {
			continue
		}
		have[s.Name] = true
		if s.Name != "dlsym" && !driver.MatchString(s.Name) {
			t.Errorf("the library exports %s, not a driver entry point nor its own interface", s.Name)
		}
	}
	for _, name := range []string{"dlsym", "cuGetProcAddress_v2", "cuMemAlloc_v2", "cuMemMap", "cuLaunchKernel", "cuMemAllocManaged", "gpucr_mark_cache", "gpucr_unmark_cache"} {
		if !have[name] {
			t.Errorf("the library does not export %s", name)
		}
	}
}

// TestStageFreed: staged pinned buffers that no copy takes are freed at
// unpark and when the connection that staged them ends (pinned host memory
// at the driver's checkpoint would go into the dump), with buffers the
// library maps and registers and with cuMemHostAlloc's where the driver
// cannot register.
func TestStageFreed(t *testing.T) {
	for _, env := range [][]string{nil, {"GPUCR_FAKE_NO_REGISTER=1"}} {
		t.Run(fmt.Sprint("env=", env), func(t *testing.T) { testStageFreed(t, env) })
	}
}

func testStageFreed(t *testing.T, env []string) {
	tg := vramtest.Start(t, env...)
	ctx := context.Background()
	staged := func() int {
		p, err := preloadctl.Dial(ctx, tg.SockDir, tg.PID)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		r, err := p.Report(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return r.Staged
	}
	for _, end := range []string{"unpark", "close"} {
		p, err := preloadctl.Dial(ctx, tg.SockDir, tg.PID)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Stage(ctx, 4); err != nil {
			t.Fatal(err)
		}
		if r, err := p.Report(ctx); err != nil || r.Staged != 4 {
			t.Fatalf("%s: after stage 4: %+v %v", end, r, err)
		}
		if end == "unpark" {
			if err := p.Park(ctx, time.Second); err != nil {
				t.Fatal(err)
			}
			if err := p.Unpark(ctx); err != nil {
				t.Fatal(err)
			}
			if r, err := p.Report(ctx); err != nil || r.Staged != 0 {
				t.Fatalf("after unpark: %d staged (%v), want 0", r.Staged, err)
			}
		}
		p.Close()
		if n := staged(); n != 0 {
			t.Fatalf("%s: %d copy threads' buffers still staged, want 0", end, n)
		}
	}
	if err := func() error {
		p, err := preloadctl.Dial(ctx, tg.SockDir, tg.PID)
		if err != nil {
			return err
		}
		defer p.Close()
		return p.Stage(ctx, 65)
	}(); err == nil || !strings.Contains(err.Error(), "want 1..64") {
		t.Fatalf("stage 65: %v, want refused", err)
	}
}

// TestFastCheckIncapable: what the library cannot recreate makes the
// process incapable, and the check says why (want "": still capable). The
// flags and access cases are noticed while the library holds its table
// lock: a target that hangs there (the library locking it twice) never
// gets ready.
func TestFastCheckIncapable(t *testing.T) {
	for _, c := range []struct{ env, want string }{
		{"FP_MANAGED=1", "cuMemAllocManaged"},
		{"FP_CREATE_FLAGS=1", "cuMemCreate with flags 1"},
		{"FP_WIDE_ACCESS=1", "access set for more than 4 locations"},
		{"FP_POOL=1", ""},
	} {
		t.Run(c.env, func(t *testing.T) {
			tg := vramtest.Start(t, c.env)
			_, err := FastCheck(context.Background(), tg.SockDir, []int{tg.PID})
			if c.want == "" {
				if err != nil {
					t.Fatalf("check of a process with %s: %v, want capable", c.env, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("check of a process with %s: %v, want %q", c.env, err, c.want)
			}
		})
	}
	tg := vramtest.Start(t)
	if _, err := FastCheck(context.Background(), tg.SockDir, []int{1 << 22}); !errors.Is(err, preloadctl.ErrNotLoaded) {
		t.Fatalf("check of a process without the library: %v", err)
	}
}

// TestFileName: every name copy out gives a file is one FilePID reads
// back, for every file count --vram-files allows.
func TestFileName(t *testing.T) {
	for _, pid := range []int{1, 42, 4194304} {
		for k := 0; k < 64; k++ {
			if got, ok := FilePID(fileName(pid, k)); !ok || got != pid {
				t.Fatalf("FilePID(%q) = %d %v, want %d", fileName(pid, k), got, ok, pid)
			}
		}
	}
}

// TestCollectiveBarrier: the library's collective barrier (preload/gate.c)
// on a target whose every launch is a collective (its kernel named as
// NCCL's, mangled and plain) or none is. A hold stops the launches where
// they are; until N lets exactly N through and holds again; a held launch
// does not keep park from closing the gate; unpark lets it go. A target
// without collectives is never held.
func TestCollectiveBarrier(t *testing.T) {
	ctx := context.Background()
	for _, name := range []string{"_Z39ncclDevKernel_AllReduce_Sum_f32_RING_LLv", "ncclKernel_AllGather"} {
		t.Run(name, func(t *testing.T) {
			tg := vramtest.Start(t, "GPUCR_FAKE_KERNEL_NAME="+name)
			p, err := preloadctl.Dial(ctx, tg.SockDir, tg.PID)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			n0, err := p.CollectivesHold(ctx)
			if err != nil {
				t.Fatal(err)
			}
			time.Sleep(50 * time.Millisecond)
			if n, err := p.CollectivesHold(ctx); err != nil || n != n0 {
				t.Fatalf("held at %d, then %d (%v): launches went on", n0, n, err)
			}
			if n, err := p.CollectivesUntil(ctx, n0+5, 5*time.Second); err != nil || n != n0+5 {
				t.Fatalf("until %d: %d, %v", n0+5, n, err)
			}
			time.Sleep(50 * time.Millisecond)
			if n, err := p.CollectivesHold(ctx); err != nil || n != n0+5 {
				t.Fatalf("held again at %d: %d, %v", n0+5, n, err)
			}
			if err := p.Park(ctx, 2*time.Second); err != nil {
				t.Fatalf("park with a launch held at the barrier: %v", err)
			}
			if err := p.Unpark(ctx); err != nil {
				t.Fatal(err)
			}
			time.Sleep(50 * time.Millisecond)
			if n, err := p.CollectivesHold(ctx); err != nil || n <= n0+5 {
				t.Fatalf("after unpark: %d collectives launched, %v: still held at %d", n, err, n0+5)
			}
			if _, err := p.CollectivesUntil(ctx, 1<<40, 100*time.Millisecond); err == nil || !strings.Contains(err.Error(), "within 100 ms") {
				t.Fatalf("until a count never reached: %v", err)
			}
			p.Close()
			// The connection that held is gone, not parked: released.
			if n1, n2 := tg.Collectives(t), tg.Collectives(t); n2 <= n1 {
				t.Fatalf("after the holder left: %d, then %d: still held", n1, n2)
			}
			tg.MustBeIntact(t)
		})
	}
	t.Run("none", func(t *testing.T) {
		tg := vramtest.Start(t)
		if n := tg.Collectives(t); n != 0 {
			t.Fatalf("a target without collectives launched %d", n)
		}
		tg.MustBeIntact(t)
	})
}
