package gpuckpt

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/cudadriver/drivertest"
	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/vram"
	"github.com/gpucr/gpucr-stream/vram/vramtest"
	"golang.org/x/sys/unix"
)

// The fast path's table (suspend.go) run on libgpucr-preload in a test
// program against a fake driver (package vramtest): what each step does
// to the processes, and that any failure undoes them, the memory back.

func TestMain(m *testing.M) {
	runFillerIfAsked()
	vramtest.Run(m)
}

// fastOpts are the fast path's options for tg in a test: 3 files, the
// kept copy and its records in directories of the test.
func fastOpts(tg *vramtest.Target, tb testing.TB) vram.FastOptions {
	return vram.FastOptions{Dir: tg.SockDir, Files: 3, ParkTimeout: 5 * time.Second, KeepDir: filepath.Join(tb.TempDir(), "keep"),
		Records: filepath.Join(tb.TempDir(), "kept")}
}

// moveOut runs the fast path's table for pids (Checkpoint.moveOut), its
// VRAM files stored with put; the driver is a fake that is not called.
func moveOut(ctx context.Context, pids []int, put vram.PutFunc, o vram.FastOptions) (*Checkpoint, error) {
	cc := &Checkpoint{drv: drivertest.NewFake(pids[0]), pids: pids}
	return cc, cc.moveOut(ctx, put, o)
}

// undoAll undoes cc's steps, as a checkpoint that fails after them does,
// and returns the undo's errors.
func undoAll(cc *Checkpoint) error { return cc.undo.unwind(context.Background()).err }

// heldReport is the report of cc's first process, asked through the
// connection that parked it.
func heldReport(ctx context.Context, cc *Checkpoint) (preloadctl.Report, error) {
	reps, err := cc.fast.Reports(ctx)
	if err != nil {
		return preloadctl.Report{}, err
	}
	return reps[0], nil
}

// fastSuspended moves tg's device memory into a new store and commits;
// with detach the library is detached and waited for first, as a
// checkpoint does between its copy and its commit.
func fastSuspended(tb testing.TB, tg *vramtest.Target, detach bool) (*vramtest.Store, *Checkpoint) {
	tb.Helper()
	ctx := context.Background()
	st := vramtest.NewStore()
	s, err := moveOut(ctx, []int{tg.PID}, st.Put, fastOpts(tg, tb))
	if err != nil {
		tb.Fatal(err)
	}
	if detach {
		if err := s.fast.Detach(ctx); err != nil {
			tb.Fatal(err)
		}
		if err := s.fast.Wait(ctx); err != nil {
			tb.Fatal(err)
		}
	}
	s.FastCommit()
	return st, s
}

// keptPaths are the paths of the kept files of cc's i-th process.
func keptPaths(cc *Checkpoint, i int) []string {
	var ps []string
	for _, name := range cc.fast.Procs()[i].Files {
		ps = append(ps, filepath.Join(cc.fast.KeepDir(), name))
	}
	return ps
}

func TestFastPathRoundTrip(t *testing.T) {
	tg := vramtest.Start(t)
	ctx := context.Background()
	fi, err := os.Stat(tg.SockDir)
	if err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("socket directory: %v %v, want mode 0700", fi.Mode(), err)
	}
	si, err := os.Stat(preloadctl.Socket(tg.SockDir, tg.PID))
	if err != nil || si.Mode().Perm() != 0o600 {
		t.Fatalf("socket: %v %v, want mode 0600", si.Mode(), err)
	}
	reps, err := vram.FastCheck(ctx, tg.SockDir, []int{tg.PID})
	if err != nil {
		t.Fatal(err)
	}
	before := reps[0]
	var want int64
	for _, r := range tg.Regions {
		want += int64(r.Size)
	}
	// Allocations are rounded up to the granularity: at least the regions.
	if before.Bytes < want || before.Allocs != 4 || before.Mappings != 6 || before.DeviceUsed == 0 {
		t.Fatalf("report before: %+v (regions %d bytes)", before, want)
	}
	st := vramtest.NewStore()
	st.Block = make(chan struct{})
	o := fastOpts(tg, t)
	s, err := moveOut(ctx, []int{tg.PID}, st.Put, o)
	if err != nil {
		t.Fatal(err)
	}
	// The device is free while nothing is stored yet: the library wrote
	// the kept copy, the store reads it after the release.
	if r, err := heldReport(ctx, s); err != nil || !r.Parked || !r.Released || r.DeviceUsed != 0 || len(r.Kept) != 3 || r.Staged != 0 {
		t.Fatalf("report after the release: %+v %v, want parked, released, no device memory in use, 3 kept files, no pinned buffers left", r, err)
	}
	// Every copy thread took the buffers staged before the park, and
	// copied what the program wrote.
	written := tg.Written(t, false)
	if c := slowest(s.fast.Procs()); c.Workers != 3 || c.Staged != 3 || c.Bytes != written || c.Allocated != before.Bytes || c.Work <= 0 {
		t.Fatalf("copy out: %+v, want 3 workers on staged buffers copying %d bytes of %d", c, written, before.Bytes)
	}
	st.Mu.Lock()
	stored := len(st.Files)
	st.Mu.Unlock()
	if stored != 0 {
		t.Fatalf("%d files stored before the store was let go", stored)
	}
	kept := map[string][]byte{}
	for i, k := range keptPaths(s, 0) {
		if fi, err := os.Stat(k); err != nil || fi.Mode().Perm() != 0o600 {
			t.Fatalf("kept file %s: %v %v, want mode 0600", k, fi, err)
		}
		b, err := os.ReadFile(k)
		if err != nil {
			t.Fatal(err)
		}
		kept[s.fast.Procs()[0].Files[i]] = b
	}
	vramtest.CheckRecords(t, tg, kept)
	close(st.Block)
	if err := s.fast.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.fast.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if s.fast.Bytes() != written || len(st.Files) != 3 || s.fast.StoreTime() <= 0 {
		t.Fatalf("copied %d bytes into %d files (store %v), want %d into 3", s.fast.Bytes(), len(st.Files), s.fast.StoreTime(), written)
	}
	for name, b := range kept {
		if !bytes.Equal(st.Files[name], b) {
			t.Fatalf("%s: stored %d bytes that are not the kept copy's %d", name, len(st.Files[name]), len(b))
		}
	}
	if r := tg.Check(t, 200*time.Millisecond); r != "" {
		t.Fatalf("a parked target answered: %q", r)
	}
	s.FastCommit()
	if ents, _ := os.ReadDir(o.KeepDir); len(ents) != 0 {
		t.Fatalf("kept copy left after the commit: %d files", len(ents))
	}
	procs := s.fast.Procs()
	if len(procs) != 1 || procs[0].PID != tg.PID || len(procs[0].Files) != 3 {
		t.Fatalf("procs %+v", procs)
	}
	if res, err := vram.FastResume(ctx, tg.SockDir, tg.PID, procs[0].Files, st.Get, nil, nil); err != nil || res.Copy.Bytes != written || res.Copy.Zero != before.Bytes-written {
		t.Fatalf("resume: %d bytes, %v", res.Copy.Bytes, err)
	}
	// Same addresses (the target reads back through its own pointers), same
	// bytes, and the kernel thread's counter matches its launches.
	tg.MustBeIntact(t)
	if r := tg.Report(t); r.Parked || r.Released || r.DeviceUsed != before.DeviceUsed {
		t.Fatalf("report after resume: %+v", r)
	}
}

func TestFastPathFaults(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name, fault string
		failAfter   int64 // a put fails (-1: none)
		full        bool  // the kept copy's file system is full (ENOSPC)
		planted     bool  // a kept file's name is a symlink planted to a file of root's
		wantSuspend bool  // the fast path's steps succeed
		wantStore   bool  // and its store too
		want        string
	}{
		{"park", "park", -1, false, false, false, false, "injected"},
		{"copy out", "copyout", -1, false, false, false, false, "injected"},
		{"no space for the kept copy", "", -1, true, false, false, false, "not enough room"},
		{"planted symlink", "", -1, false, true, false, false, "file exists"},
		{"release", "release", -1, false, false, false, false, "injected"},
		{"store after release", "", 1 << 20, false, false, true, false, "injected destination failure"},
		{"store fails at once", "", 0, false, false, true, false, "injected destination failure"},
		{"after release", "", -1, false, false, true, true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var env []string
			if tc.fault != "" {
				env = append(env, "GPUCR_PRELOAD_FAULT="+tc.fault)
			}
			tg := vramtest.Start(t, env...)
			used := tg.Report(t).DeviceUsed
			st := vramtest.NewStore()
			st.FailAfter = tc.failAfter
			o := fastOpts(tg, t)
			if tc.full {
				// The file system fills up under the library's writes.
				vramtest.MustRoot(t)
				if err := os.MkdirAll(o.KeepDir, 0o700); err != nil {
					t.Fatal(err)
				}
				if err := unix.Mount("full", o.KeepDir, "tmpfs", 0, "size=64k,mode=0700"); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { unix.Unmount(o.KeepDir, unix.MNT_DETACH) })
			}
			// Issue 25 H1: whoever may write into the kept copy's
			// directory plants a symlink to a file of root's in place of
			// a kept file: it is neither truncated nor handed over.
			victim := filepath.Join(t.TempDir(), "root-only")
			if tc.planted {
				if err := os.WriteFile(victim, []byte("root's"), 0o600); err != nil {
					t.Fatal(err)
				}
				if err := os.MkdirAll(o.KeepDir, 0o700); err != nil {
					t.Fatal(err)
				}
				link := filepath.Join(o.KeepDir, fmt.Sprintf("vram-%d-01.bin", tg.PID))
				if err := os.Symlink(victim, link); err != nil {
					t.Fatal(err)
				}
				defer func() {
					if b, err := os.ReadFile(victim); err != nil || string(b) != "root's" {
						t.Errorf("the planted symlink's target: %q %v, want it untouched", b, err)
					}
				}()
				defer os.Remove(link)
			}
			s, err := moveOut(ctx, []int{tg.PID}, st.Put, o)
			if (err == nil) != tc.wantSuspend {
				t.Fatalf("suspend: %v", err)
			}
			if err == nil {
				// The owning connection is still held: ask through it.
				if r, err := heldReport(ctx, s); err != nil || !r.Released || len(r.Kept) != 3 {
					t.Fatalf("not released with a kept copy of 3 files: %+v %v", r, err)
				}
				err = s.fast.Wait(ctx)
				if (err == nil) != tc.wantStore {
					t.Fatalf("store: %v", err)
				}
				// What follows the release failed (the store, CRIU, the
				// driver, the commit): the undo refills from the kept copy.
				if uerr := undoAll(s); uerr != nil {
					t.Fatal(uerr)
				}
			}
			if tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
			tg.MustBeIntact(t)
			r := tg.Report(t)
			if r.Parked || r.Released || r.DeviceUsed != used {
				t.Fatalf("after the undo: %+v, want running with %d bytes of device memory", r, used)
			}
			if ents, _ := os.ReadDir(o.KeepDir); len(ents) != map[bool]int{true: 1}[tc.planted] {
				t.Fatalf("kept copy left behind: %d files", len(ents))
			}
		})
	}
}

// An undo while the store is held up (a destination that stalls) stops
// the store and refills at once.
func TestFastPathUndoStalledStore(t *testing.T) {
	ctx := context.Background()
	tg := vramtest.Start(t)
	st := vramtest.NewStore()
	st.Block = make(chan struct{}) // never let go
	o := fastOpts(tg, t)
	s, err := moveOut(ctx, []int{tg.PID}, st.Put, o)
	if err != nil {
		t.Fatal(err)
	}
	if err := undoAll(s); err != nil {
		t.Fatal(err)
	}
	if err := s.fast.Wait(ctx); !errors.Is(err, vram.ErrUndone) {
		t.Fatalf("store after the undo: %v, want %v", err, vram.ErrUndone)
	}
	tg.MustBeIntact(t)
	if ents, _ := os.ReadDir(o.KeepDir); len(ents) != 0 {
		t.Fatalf("kept copy left behind: %d files", len(ents))
	}
}

// TestFastPathTwoProcesses: two processes (a tree's ranks) are copied out
// at once, both released, stored, and each comes back intact.
func TestFastPathTwoProcesses(t *testing.T) {
	a := vramtest.Start(t)
	b := vramtest.Start(t, "GPUCR_PRELOAD_DIR="+a.SockDir) // one socket dir
	ctx := context.Background()
	st := vramtest.NewStore()
	o := fastOpts(a, t)
	s, err := moveOut(ctx, []int{a.PID, b.PID}, st.Put, o)
	if err != nil {
		t.Fatal(err)
	}
	reps, err := s.fast.Reports(ctx)
	if err != nil || len(reps) != 2 {
		t.Fatalf("reports after the release: %+v %v", reps, err)
	}
	for _, r := range reps {
		if !r.Released || r.DeviceUsed != 0 {
			t.Fatalf("process %d after the release: %+v", r.PID, r)
		}
	}
	if err := s.fast.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.fast.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	s.FastCommit()
	procs := s.fast.Procs()
	if len(procs) != 2 || len(st.Files) != 6 {
		t.Fatalf("procs %+v, %d files stored, want 2 processes and 6 files", procs, len(st.Files))
	}
	for i, tg := range []*vramtest.Target{a, b} {
		if _, err := vram.FastResume(ctx, a.SockDir, procs[i].PID, procs[i].Files, st.Get, nil, nil); err != nil {
			t.Fatalf("resume %d: %v", procs[i].PID, err)
		}
		tg.MustBeIntact(t)
	}
}

// TestFastPathSharedMemory: a process that maps memory it imported through
// a shareable handle (here its own export, as an NCCL rank maps a peer's
// buffer) takes the fast path: the import is released with the rest and
// never copied; after the refill the process stays parked until vram.Reimport
// has the exporter export its new handle and the importer map it where
// the old one was; then both addresses hold the refilled bytes. The undo
// (a failed checkpoint) does the same.
func TestFastPathSharedMemory(t *testing.T) {
	ctx := context.Background()
	tg := vramtest.Start(t, "FP_SELF_SHARE=1")
	reps, err := vram.FastCheck(ctx, tg.SockDir, []int{tg.PID})
	if err != nil {
		t.Fatalf("a process that imports its own export: %v, want capable", err)
	}
	var own int64
	for _, r := range tg.Regions {
		if r.Name != "imported" {
			own += int64(r.Size)
		}
	}
	if reps[0].Bytes < own || reps[0].Bytes >= own+2<<20+3<<20 {
		t.Fatalf("report: %d bytes, want the process's own (%d, rounded up), not the import", reps[0].Bytes, own)
	}
	tg.MustBeIntact(t)

	st, s := fastSuspended(t, tg, false)
	files := s.fast.Procs()[0].Files
	if _, err := vram.FastResume(ctx, tg.SockDir, tg.PID, files, st.Get, nil, nil); err != nil {
		t.Fatal(err)
	}
	if r := tg.Report(t); !r.Parked {
		t.Fatalf("after the refill, the import not mapped again: %+v, want parked", r)
	}
	// What the process says it imported from is believed only for a
	// process of the tree: pid 1 is not, and the process stays parked.
	p, err := preloadctl.Dial(ctx, tg.SockDir, tg.PID)
	if err != nil {
		t.Fatal(err)
	}
	sh, err := p.Shared(ctx)
	if err != nil || len(sh.Imports) != 1 || sh.Imports[0].SrcPID != tg.PID {
		t.Fatalf("shared after the refill: %+v %v, want one import, from the process itself", sh, err)
	}
	im := sh.Imports[0]
	if err := p.Source(ctx, im.H, 1, im.SrcH); err != nil {
		t.Fatal(err)
	}
	p.Close()
	if err := vram.Reimport(ctx, tg.SockDir, []int{tg.PID}); !errors.Is(err, vram.ErrSharedOutside) {
		t.Fatalf("reimport from a process outside the tree: %v, want vram.ErrSharedOutside", err)
	}
	if r := tg.Report(t); !r.Parked {
		t.Fatalf("after a refused reimport: %+v, want parked", r)
	}
	p, err = preloadctl.Dial(ctx, tg.SockDir, tg.PID)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Source(ctx, im.H, im.SrcPID, im.SrcH); err != nil {
		t.Fatal(err)
	}
	p.Close()
	if err := vram.Reimport(ctx, tg.SockDir, []int{tg.PID}); err != nil {
		t.Fatal(err)
	}
	if r := tg.Report(t); r.Parked {
		t.Fatalf("after vram.Reimport: %+v, want running", r)
	}
	tg.MustBeIntact(t)

	// The undo of a checkpoint that failed after the release.
	st2 := vramtest.NewStore()
	s2, err := moveOut(ctx, []int{tg.PID}, st2.Put, fastOpts(tg, t))
	if err != nil {
		t.Fatal(err)
	}
	if err := undoAll(s2); err != nil {
		t.Fatalf("undo: %v", err)
	}
	if r := tg.Report(t); r.Parked {
		t.Fatalf("after the undo: %+v, want running", r)
	}
	tg.MustBeIntact(t)
}

// TestStagedRound: every copy thread takes the pinned buffers staged
// before the park, those the library registers and (where the driver
// cannot register) cuMemHostAlloc's, and the round trip holds.
func TestStagedRound(t *testing.T) {
	for _, env := range [][]string{nil, {"GPUCR_FAKE_NO_REGISTER=1"}} {
		t.Run(fmt.Sprint("env=", env), func(t *testing.T) {
			tg := vramtest.Start(t, env...)
			st, s := fastSuspended(t, tg, true)
			if c := slowest(s.fast.Procs()); c.Staged != 3 {
				t.Fatalf("copy out: %+v, want 3 workers on staged buffers", c)
			}
			if res, err := vram.FastResume(context.Background(), tg.SockDir, tg.PID, s.fast.Procs()[0].Files, st.Get, nil, nil); err != nil || res.Copy.Bytes != s.fast.Bytes() {
				t.Fatalf("resume: %+v %v", res.Copy, err)
			}
			tg.MustBeIntact(t)
		})
	}
}

// TestSuspendAfterFastPath: the driver's steps go on the fast path's undo
// stack. A driver checkpoint that fails undoes the driver's lock, then
// refills the memory the fast path released, and the process runs on;
// one that succeeds, with the store done, is brought back by Resume
// (--leave-running), the driver's state first, the refill timed.
func TestSuspendAfterFastPath(t *testing.T) {
	ctx := context.Background()
	for _, fail := range []bool{true, false} {
		t.Run(fmt.Sprint("checkpoint fails=", fail), func(t *testing.T) {
			tg := vramtest.Start(t)
			used := tg.Report(t).DeviceUsed
			o := fastOpts(tg, t)
			cc, err := moveOut(ctx, []int{tg.PID}, vramtest.NewStore().Put, o)
			if err != nil {
				t.Fatal(err)
			}
			script := map[string]cudadriver.Result{}
			if fail {
				script[fmt.Sprintf("checkpoint %d", tg.PID)] = cudadriver.ErrorUnknown
			}
			d := newScripted(script, tg.PID)
			cc.drv = d
			ps, err := cc.Suspend(ctx, 0)
			if fail {
				if err == nil || !strings.Contains(err.Error(), "restored and unlocked") {
					t.Fatalf("Suspend = %v, want the failure undone", err)
				}
				if got := phaseNames(ps); got != "gpu lock, gpu checkpoint, gpu unlock" {
					t.Fatalf("Suspend's phases: %s", got)
				}
				if got, want := d.log(), fmt.Sprintf("lock %d, checkpoint %d, unlock %d", tg.PID, tg.PID, tg.PID); got != want {
					t.Fatalf("driver calls %q, want %q", got, want)
				}
			} else {
				if err != nil {
					t.Fatal(err)
				}
				if err := cc.FastWait(ctx); err != nil {
					t.Fatal(err)
				}
				if got := phaseNames(ps); got != "gpu lock, gpu checkpoint" {
					t.Fatalf("Suspend's phases: %s", got)
				}
				ps, err = cc.Resume()
				if err != nil {
					t.Fatal(err)
				}
				if got := phaseNames(ps); got != "gpu restore, gpu unlock, vram refill" {
					t.Fatalf("Resume's phases: %s", got)
				}
			}
			tg.MustBeIntact(t)
			if r := tg.Report(t); r.Parked || r.Released || r.DeviceUsed != used {
				t.Fatalf("after the undo: %+v, want running with %d bytes of device memory", r, used)
			}
			if ents, _ := os.ReadDir(o.KeepDir); len(ents) != 0 {
				t.Fatalf("kept copy left behind: %d files", len(ents))
			}
		})
	}
}

// phaseNames lists the names of ps.
func phaseNames(ps []Phase) string {
	var names []string
	for _, p := range ps {
		names = append(names, p.Name)
	}
	return strings.Join(names, ", ")
}
