package vram

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/preloadctl"
)

// Issue 25: root acts for processes of other users, so nothing the process
// (or its user) says may steer what root opens, creates or removes, and
// neither end of the control socket talks to a stranger.

// TestRecoverOnlyWhatWasKept (H3): `gpu resume --pid` refills a process
// only from the copy gpucr-stream recorded, never from the paths the
// library reports: without a record it refuses, even where those paths
// hold a valid copy; a recorded file replaced by a symlink is not opened.
func TestRecoverOnlyWhatWasKept(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		attack func(t *testing.T, o FastOptions, kept []string)
		want   string
	}{
		{"no record", func(t *testing.T, o FastOptions, _ []string) {
			os.RemoveAll(o.Records)
		}, "kept no copy"},
		{"record of another process", func(t *testing.T, o FastOptions, _ []string) {
			ents, _ := os.ReadDir(o.Records)
			for _, e := range ents {
				b, _ := os.ReadFile(filepath.Join(o.Records, e.Name()))
				os.WriteFile(filepath.Join(o.Records, e.Name()), []byte(strings.Replace(string(b), `"start":`, `"start":1`, 1)), 0o600)
			}
		}, "another process"},
		{"kept file swapped for a symlink", func(t *testing.T, o FastOptions, kept []string) {
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
			tg := startTarget(t)
			o := fastOpts(tg, t)
			s, err := FastSuspend(ctx, []int{tg.pid}, newStore().put, o)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if err := s.BeforeDriver(ctx); err != nil {
				t.Fatal(err)
			}
			if err := s.Detach(ctx); err != nil {
				t.Fatal(err)
			}
			kept := keptPaths(s, 0)
			if r := tg.report(t); !r.Parked || !r.Released || len(r.Kept) != 3 {
				t.Fatalf("report: %+v", r)
			}
			tc.attack(t, o, kept)
			_, err = FastRecover(ctx, tg.sockDir, o.Records, []int{tg.pid})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("recover: %v, want %q", err, tc.want)
			}
			if r := tg.check(t, 200*time.Millisecond); r != "" {
				t.Fatalf("the target ran: %q", r)
			}
		})
	}
}

// TestDialChecksListener (L6): a socket in the process's place served by
// someone else is refused.
func TestDialChecksListener(t *testing.T) {
	tg := startTarget(t)
	dir := t.TempDir()
	l, err := net.Listen("unix", preloadctl.Socket(dir, tg.pid))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("ok {\"capable\":true}\n"))
			defer c.Close()
		}
	}()
	_, err = preloadctl.Dial(context.Background(), dir, tg.pid)
	if !errors.Is(err, preloadctl.ErrNotTheProcess) || !strings.Contains(err.Error(), "served by process "+strconv.Itoa(os.Getpid())) {
		t.Fatalf("dial a stranger's socket: %v, want %v", err, preloadctl.ErrNotTheProcess)
	}
	if _, err := preloadctl.Dial(context.Background(), tg.sockDir, tg.pid); err != nil {
		t.Fatalf("dial the process's own socket: %v", err)
	}
}

// TestSocketDirSymlink (L5): a GPUCR_PRELOAD_DIR that is a symlink gets no
// socket, and what it points to keeps its mode.
func TestSocketDirSymlink(t *testing.T) {
	base := t.TempDir()
	real := filepath.Join(base, "real")
	if err := os.Mkdir(real, 0o755); err != nil {
		t.Fatal(err)
	}
	os.Chmod(real, 0o755)
	link := filepath.Join(base, "link")
	if err := os.Symlink(real, link); err != nil {
		t.Fatal(err)
	}
	tg := startTarget(t, "GPUCR_PRELOAD_DIR="+link)
	fi, err := os.Stat(real)
	if err != nil || fi.Mode().Perm() != 0o755 {
		t.Fatalf("the symlink's target: %v %v, want mode 0755 untouched", fi.Mode(), err)
	}
	if ents, _ := os.ReadDir(real); len(ents) != 0 {
		t.Fatalf("a socket made through the symlink: %d entries", len(ents))
	}
	_ = tg
}

// TestIdleClient (L7): a client that connects and says nothing holds the
// library only for its idle timeout; the next is served.
func TestIdleClient(t *testing.T) {
	tg := startTarget(t, "GPUCR_PRELOAD_IDLE_MS=300")
	c, err := net.Dial("unix", preloadctl.Socket(tg.sockDir, tg.pid))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	time.Sleep(50 * time.Millisecond) // accepted first
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	p, err := preloadctl.Dial(ctx, tg.sockDir, tg.pid)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if _, err := p.Report(ctx); err != nil {
		t.Fatalf("served after an idle client: %v", err)
	}
}

// TestKeepRemovesNothingNamed (L7): keep and recover cannot make the
// library unlink a file: a client that hands over a file of its choice as
// the kept copy, then refills through recover, leaves it in place.
func TestKeepRemovesNothingNamed(t *testing.T) {
	ctx := context.Background()
	tg := startTarget(t)
	victimDir := t.TempDir()
	victim := filepath.Join(victimDir, "precious")
	if err := os.WriteFile(victim, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := preloadctl.Dial(ctx, tg.sockDir, tg.pid)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := p.Park(ctx, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	copyDir := t.TempDir()
	var ws []*os.File
	for k := range 2 {
		w, err := os.Create(filepath.Join(copyDir, strconv.Itoa(k)))
		if err != nil {
			t.Fatal(err)
		}
		ws = append(ws, w)
	}
	if _, err := p.CopyOut(ctx, ws); err != nil {
		t.Fatal(err)
	}
	closeAll(ws)
	d, err := os.Open(victimDir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	v, err := os.Open(victim)
	if err != nil {
		t.Fatal(err)
	}
	err = p.Keep(ctx, d, []*os.File{v})
	v.Close()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Release(ctx); err != nil {
		t.Fatal(err)
	}
	var rs []*os.File
	for k := range 2 {
		r, err := os.Open(filepath.Join(copyDir, strconv.Itoa(k)))
		if err != nil {
			t.Fatal(err)
		}
		rs = append(rs, r)
	}
	err = p.Recover(ctx, rs)
	closeAll(rs)
	if err != nil {
		t.Fatal(err)
	}
	tg.mustBeIntact(t)
	if _, err := os.Stat(victim); err != nil {
		t.Fatalf("the file handed over as the kept copy: %v, want it in place", err)
	}
}

// TestOtherPIDNamespace (L6): a process in a pid (and mount) namespace of
// its own names its socket by its pid there; gpucr-stream finds it by
// the process's NSpid, through its root, and checks it is the process.
func TestOtherPIDNamespace(t *testing.T) {
	mustRoot(t)
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Fatal("unshare (util-linux) is needed")
	}
	tg := startWrapped(t, []string{unshare, "--pid", "--fork", "--mount-proc"})
	self, err1 := os.Readlink("/proc/self/ns/pid")
	its, err2 := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", tg.pid))
	if err1 != nil || err2 != nil || self == its {
		t.Fatalf("process %d: pid namespace %q (%v, %v), want one of its own", tg.pid, its, err1, err2)
	}
	ctx := context.Background()
	reps, err := FastCheck(ctx, tg.sockDir, []int{tg.pid})
	if err != nil || len(reps) != 1 {
		t.Fatalf("report across pid namespaces: %v %v", reps, err)
	}
	o := fastOpts(tg, t)
	st := newStore()
	s, err := FastSuspend(ctx, []int{tg.pid}, st.put, o)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Undo(ctx); err != nil {
		t.Fatal(err)
	}
	tg.mustBeIntact(t)
}
