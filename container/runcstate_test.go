package container

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/e2e"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/testwait"
)

// fakeRuncState writes runc's state file of container id into root, its
// init pid started at start, in freezer dir (both cgroup versions'
// files, so that the host's version finds its own).
func fakeRuncState(t *testing.T, root, id string, pid int, start uint64, freezer string) {
	t.Helper()
	f := runcStateFile{ID: id, InitProcessPid: pid, InitProcessStart: start,
		CgroupPaths: map[string]string{"freezer": freezer, "": freezer}}
	f.Config.Labels = []string{"bundle=/b/" + id}
	b, err := json.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(root, id), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, id, "state.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// writeFreezer makes dir a fake freezer cgroup in state v1 (THAWED,
// FREEZING, FROZEN), v2's cgroup.freeze to match.
func writeFreezer(t *testing.T, dir, v1 string, self bool) {
	t.Helper()
	v2, selfText := "0", "0"
	if v1 == "FROZEN" && self {
		v2 = "1"
	}
	if self {
		selfText = "1"
	}
	for name, body := range map[string]string{"freezer.state": v1, "freezer.self_freezing": selfText, "cgroup.freeze": v2} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRuncStateFile: the state runc's files give, as runc works it out,
// and what they leave to `runc state`.
func TestRuncStateFile(t *testing.T) {
	root := t.TempDir()
	self := os.Getpid()
	start, _ := proc.StartTime(self)
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	cg := func(v1 string, selfFrozen bool) string {
		d := t.TempDir()
		writeFreezer(t, d, v1, selfFrozen)
		return d
	}
	for _, c := range []struct {
		id      string
		pid     int
		start   uint64
		freezer string
		fifo    bool
		want    string // status; "": left to runc state
	}{
		{"running", self, start, cg("THAWED", false), false, "running"},
		{"no-freezer", self, start, "", false, "running"},
		{"gone-freezer", self, start, filepath.Join(root, "nowhere"), false, "running"},
		{"paused", self, start, cg("FROZEN", true), false, "paused"},
		{"ancestor-frozen", self, start, cg("FROZEN", false), false, "running"},
		{"created", self, start, cg("THAWED", false), true, "created"},
		{"pid-reused", self, start + 1, cg("THAWED", false), false, "stopped"},
		{"exited", gone.Process.Pid, start, cg("THAWED", false), false, "stopped"},
	} {
		t.Run(c.id, func(t *testing.T) {
			fakeRuncState(t, root, c.id, c.pid, c.start, c.freezer)
			if c.fifo {
				if err := os.WriteFile(filepath.Join(root, c.id, "exec.fifo"), nil, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			r := &runc{o: Options{Root: root}}
			st, ok, err := r.stateFromFile(c.id)
			if !ok || err != nil {
				t.Fatalf("not settled: %v, %v", ok, err)
			}
			wantPID := c.pid
			if c.want == "stopped" {
				wantPID = 0
			}
			if st.Status != c.want || st.PID != wantPID || st.ID != c.id || st.Bundle != "/b/"+c.id {
				t.Errorf("state %+v, want %s with init %d", st, c.want, wantPID)
			}
		})
	}
	r := &runc{o: Options{Root: root}}
	if _, ok, err := r.stateFromFile("none"); !ok || !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("no container: %v, %v", ok, err)
	}
	// Left to runc state: an ID runc refuses, a file not runc's, a freezer
	// still freezing (only on cgroup v1, where freezer.state is read).
	if err := os.MkdirAll(filepath.Join(root, "bad"), 0o700); err != nil || os.WriteFile(filepath.Join(root, "bad", "state.json"), []byte("{"), 0o600) != nil {
		t.Fatal("bad state file")
	}
	fakeRuncState(t, root, "other", self, start, "")
	if err := os.Rename(filepath.Join(root, "other"), filepath.Join(root, "another")); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"../x", ".", "a b", "bad", "another"} {
		if st, ok, err := r.stateFromFile(id); ok {
			t.Errorf("%q settled by the file: %+v, %v", id, st, err)
		}
	}
	fakeRuncState(t, root, "freezing", self, start, cg("FREEZING", false))
	var sfs unix.Statfs_t
	if err := unix.Statfs("/sys/fs/cgroup", &sfs); err == nil && sfs.Type != unix.CGROUP2_SUPER_MAGIC {
		if st, ok, _ := r.stateFromFile("freezing"); ok {
			t.Errorf("a freezing container settled by the file: %+v", st)
		}
	}
}

// TestRuncStateAgrees: for a real runc container, running, paused,
// resumed, created and stopped, the state file says what `runc state`
// says.
func TestRuncStateAgrees(t *testing.T) {
	rbin := e2e.Runtime(t, "runc")
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
	defer cancel()
	dir := e2e.ShortTempDir(t)
	_, root, id, _ := e2e.RuncContainer(ctx, t, dir, 8)
	r := &runc{o: Options{Root: root, Binary: rbin}}
	agree := func(what, id string) {
		t.Helper()
		fromFile, ok, err := r.stateFromFile(id)
		if !ok || err != nil {
			t.Fatalf("%s: the state file did not settle it: %v, %v", what, ok, err)
		}
		out, _, err := command(ctx, "", rbin, "--root", root, "state", id)
		if err != nil {
			t.Fatal(err)
		}
		var fromRunc runcState
		if err := json.Unmarshal([]byte(out), &fromRunc); err != nil {
			t.Fatal(err)
		}
		if fromFile != fromRunc {
			t.Errorf("%s: state file %+v, runc state %+v", what, fromFile, fromRunc)
		}
	}
	do := func(args ...string) {
		t.Helper()
		if _, _, err := command(ctx, "", rbin, append([]string{"--root", root}, args...)...); err != nil {
			t.Fatal(err)
		}
	}
	agree("running", id)
	do("pause", id)
	agree("paused", id)
	do("resume", id)
	agree("resumed", id)
	created := id + "-created"
	t.Cleanup(func() { exec.Command(rbin, "--root", root, "delete", "--force", created).Run() })
	do("create", "--bundle", filepath.Join(dir, "bundle"), created)
	agree("created", created)
	st, _, _ := r.stateFromFile(id)
	do("kill", id, "KILL")
	if err := e2e.WaitPIDGone(ctx, st.PID); err != nil {
		t.Fatal(err)
	}
	agree("stopped", id)
}
