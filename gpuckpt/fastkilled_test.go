package gpuckpt

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/testwait"
	"github.com/gpucr/gpucr-stream/vram"
	"github.com/gpucr/gpucr-stream/vram/vramtest"
)

// gpucr-stream killed in the middle of the fast path: the library brings
// its process back by itself, or `gpu resume --pid` does from the copy
// gpucr-stream recorded (vram/kept.go), never from what the process says.

// gpucr-stream dies between the release and the commit, while it stores
// the VRAM files from the kept copy: its connections end without Detach. Before the driver's lock was announced the library
// refills from the kept copy and unparks by itself; after it, the process
// waits, parked, until vram.FastRecover (gpu resume --pid) after the driver's
// restore. A damaged or missing kept copy leaves it parked, and it says so.
func TestFastPathOrphaned(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		driver bool                         // BeforeDriver was said
		damage func(t *testing.T, k string) // the kept file with most ranges
		state  string                       // what the status file says
		runs   bool                         // the program runs on by itself
	}{
		{name: "before the driver", state: "resumed", runs: true},
		{name: "after the driver", driver: true, state: "waiting"},
		{name: "damaged kept copy", damage: truncate, state: "NOT RESUMED"},
		{name: "kept copy garbage", damage: garble, state: "NOT RESUMED"},
		{name: "kept copy removed", damage: remove, state: "resumed", runs: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tg := vramtest.Start(t)
			used := tg.Report(t).DeviceUsed
			st := vramtest.NewStore()
			st.Block = make(chan struct{}) // the store is in flight
			o := fastOpts(tg, t)
			s, err := moveOut(ctx, []int{tg.PID}, st.Put, o)
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				close(st.Block)
				_ = s.fast.Wait(ctx) // the test's own goroutines, not the library's
			}()
			keptBytes := map[string][]byte{}
			for _, k := range keptPaths(s, 0) {
				b, err := os.ReadFile(k)
				if err != nil {
					t.Fatal(err)
				}
				keptBytes[k] = b
			}
			if tc.driver {
				if err := s.fast.BeforeDriver(ctx); err != nil {
					t.Fatal(err)
				}
			}
			keep := keptPaths(s, 0)
			if tc.damage != nil {
				big := keep[0]
				for _, k := range keep {
					if fi, err := os.Stat(k); err == nil && fi.Size() > vramtest.MustSize(t, big) {
						big = k
					}
				}
				tc.damage(t, big)
			}
			// gpucr-stream dies: its connection ends, nothing else.
			s.fast.HangUp(ctx)
			status := preloadctl.StatusFile(tg.SockDir, tg.PID)
			var said []byte
			for end := time.Now().Add(testwait.Scale(5 * time.Second)); time.Now().Before(end) && len(said) == 0; time.Sleep(5 * time.Millisecond) {
				said, _ = os.ReadFile(status)
			}
			if !strings.HasPrefix(string(said), tc.state+":") {
				t.Fatalf("status file: %q, want %q", said, tc.state)
			}
			if out, _ := os.ReadFile(tg.Out); !strings.Contains(string(out), "gpucr-preload["+strconv.Itoa(tg.PID)+"]: "+tc.state+":") {
				t.Fatalf("the process said nothing on stderr: %q", out)
			}
			if !tc.runs {
				recoverOrphan(t, tg, o.Records, tc.driver, tc.state, said, keptBytes, tc.damage != nil)
			}
			tg.MustBeIntact(t)
			if r := tg.Report(t); r.Parked || r.Released || r.DeviceUsed != used || len(r.Kept) != 0 {
				t.Fatalf("after: %+v, want running with %d bytes of device memory", r, used)
			}
			if ents, _ := os.ReadDir(o.KeepDir); len(ents) != 0 {
				t.Fatalf("kept copy left behind: %d files", len(ents))
			}
			// Nothing more to do for the undo of the dead gpucr-stream's
			// state (a second recover finds the process running).
			if done, err := vram.FastRecover(ctx, tg.SockDir, o.Records, []int{tg.PID}, nil); err != nil || len(done) != 0 {
				t.Fatalf("second recover: %v %v", done, err)
			}
		})
	}
}

// recoverOrphan checks that tg, whose gpucr-stream died, waits parked
// (what its status said), and brings it back with FastRecover, as `gpu
// resume --pid` does: from a damaged kept copy it refuses, repaired
// (keptBytes, as the copy went into the checkpoint) it refills.
func recoverOrphan(t *testing.T, tg *vramtest.Target, records string, driver bool, state string, said []byte, keptBytes map[string][]byte, damaged bool) {
	t.Helper()
	ctx := context.Background()
	if r := tg.Check(t, 200*time.Millisecond); r != "" {
		t.Fatalf("the target ran: %q (%s)", r, said)
	}
	// Released, or (a refill that failed) mapped again but not
	// refilled: never running.
	if r := tg.Report(t); !r.Parked || !(r.Released || r.Unfilled) || r.Driver != driver || len(r.Kept) != 3 {
		t.Fatalf("report: %+v", r)
	}
	if state == "waiting" && !strings.Contains(string(said), "gpu resume --pid "+strconv.Itoa(tg.PID)) {
		t.Fatalf("the status does not say what to run: %s", said)
	}
	if damaged {
		if _, err := vram.FastRecover(ctx, tg.SockDir, records, []int{tg.PID}, nil); err == nil {
			t.Fatal("recover from a damaged kept copy succeeded")
		}
		for k, b := range keptBytes {
			if err := os.WriteFile(k, b, 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}
	done, err := vram.FastRecover(ctx, tg.SockDir, records, []int{tg.PID}, nil)
	if err != nil || len(done) != 1 {
		t.Fatalf("recover: %v %v", done, err)
	}
	if b, _ := os.ReadFile(preloadctl.StatusFile(tg.SockDir, tg.PID)); !strings.HasPrefix(string(b), "resumed: recover") {
		t.Fatalf("status after recover: %q", b)
	}
}

func truncate(t *testing.T, k string) {
	if err := os.Truncate(k, vramtest.MustSize(t, k)-100); err != nil {
		t.Fatal(err)
	}
}

// garble overwrites the first record's header: its range is not a piece.
func garble(t *testing.T, k string) {
	f, err := os.OpenFile(k, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt([]byte{1, 2, 3, 4, 5, 6, 7, 8}, 8); err != nil {
		t.Fatal(err)
	}
}

// remove unlinks the file: the library holds it open, so it still refills.
func remove(t *testing.T, k string) {
	if err := os.Remove(k); err != nil {
		t.Fatal(err)
	}
}

// After Detach the library holds only the paths: a kept copy removed then
// cannot refill the process, which stays parked; recover says so.
func TestFastRecoverMissing(t *testing.T) {
	ctx := context.Background()
	tg := vramtest.Start(t)
	o := fastOpts(tg, t)
	s, err := moveOut(ctx, []int{tg.PID}, vramtest.NewStore().Put, o)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.fast.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if r := tg.Report(t); !r.Detached || len(r.Kept) != 3 {
		t.Fatalf("report: %+v", r)
	}
	s.FastCommit() // removes the kept copy
	if _, err := vram.FastRecover(ctx, tg.SockDir, o.Records, []int{tg.PID}, nil); err == nil || !strings.Contains(err.Error(), "kept no copy") || !strings.Contains(err.Error(), "--from") {
		t.Fatalf("recover without the kept copy: %v", err)
	}
	if r := tg.Report(t); !r.Parked || !r.Released {
		t.Fatalf("report: %+v", r)
	}
	if r := tg.Check(t, 200*time.Millisecond); r != "" {
		t.Fatalf("the target ran: %q", r)
	}
}

// TestRecoverOnlyWhatWasKept (H3): `gpu resume --pid` refills a process
// only from the copy gpucr-stream recorded, never from the paths the
// library reports: without a record it refuses, even where those paths
// hold a valid copy; a recorded file replaced by a symlink is not opened.
func TestRecoverOnlyWhatWasKept(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		attack func(t *testing.T, o vram.FastOptions, kept []string)
		want   string
	}{
		{"no record", func(t *testing.T, o vram.FastOptions, _ []string) {
			os.RemoveAll(o.Records)
		}, "kept no copy"},
		{"record of another process", func(t *testing.T, o vram.FastOptions, _ []string) {
			ents, _ := os.ReadDir(o.Records)
			for _, e := range ents {
				b, _ := os.ReadFile(filepath.Join(o.Records, e.Name()))
				os.WriteFile(filepath.Join(o.Records, e.Name()), []byte(strings.Replace(string(b), `"start":`, `"start":1`, 1)), 0o600)
			}
		}, "another process"},
		{"kept file swapped for a symlink", func(t *testing.T, o vram.FastOptions, kept []string) {
			secret := filepath.Join(t.TempDir(), "secret")
			b, err := os.ReadFile(kept[0])
			if err != nil {
				t.Fatal(err)
			}
			// A valid copy, but not the kept file.
			if err := os.WriteFile(secret, b, 0o600); err != nil {
				t.Fatal(err)
			}
			os.Remove(kept[0])
			if err := os.Symlink(secret, kept[0]); err != nil {
				t.Fatal(err)
			}
		}, "symbolic link"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tg := vramtest.Start(t)
			o := fastOpts(tg, t)
			s, err := moveOut(ctx, []int{tg.PID}, vramtest.NewStore().Put, o)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.fast.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if err := s.fast.BeforeDriver(ctx); err != nil {
				t.Fatal(err)
			}
			if err := s.fast.Detach(ctx); err != nil {
				t.Fatal(err)
			}
			kept := keptPaths(s, 0)
			if r := tg.Report(t); !r.Parked || !r.Released || len(r.Kept) != 3 {
				t.Fatalf("report: %+v", r)
			}
			tc.attack(t, o, kept)
			_, err = vram.FastRecover(ctx, tg.SockDir, o.Records, []int{tg.PID}, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("recover: %v, want %q", err, tc.want)
			}
			if r := tg.Check(t, 200*time.Millisecond); r != "" {
				t.Fatalf("the target ran: %q", r)
			}
		})
	}
}

// TestOtherPIDNamespace (L6): a process in a pid (and mount) namespace of
// its own names its socket by its pid there; gpucr-stream finds it by
// the process's NSpid, through its root, and checks it is the process.
func TestOtherPIDNamespace(t *testing.T) {
	vramtest.MustRoot(t)
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Fatal("unshare (util-linux) is needed")
	}
	tg := vramtest.StartWrapped(t, []string{unshare, "--pid", "--fork", "--mount-proc"})
	self, err1 := os.Readlink("/proc/self/ns/pid")
	its, err2 := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", tg.PID))
	if err1 != nil || err2 != nil || self == its {
		t.Fatalf("process %d: pid namespace %q (%v, %v), want one of its own", tg.PID, its, err1, err2)
	}
	ctx := context.Background()
	reps, err := vram.FastCheck(ctx, tg.SockDir, []int{tg.PID})
	if err != nil || len(reps) != 1 {
		t.Fatalf("report across pid namespaces: %v %v", reps, err)
	}
	o := fastOpts(tg, t)
	st := vramtest.NewStore()
	s, err := moveOut(ctx, []int{tg.PID}, st.Put, o)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.fast.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := undoAll(s); err != nil {
		t.Fatal(err)
	}
	tg.MustBeIntact(t)
}
