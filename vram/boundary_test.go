package vram

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/testwait"
	"github.com/gpucr/gpucr-stream/vram/vramtest"
)

// Issue 25: root acts for processes of other users, so nothing the process
// (or its user) says may steer what root opens, creates or removes, and
// neither end of the control socket talks to a stranger. (The kept copy's
// record, and a process in a pid namespace of its own: gpuckpt's tests.)

// TestDialChecksListener (L6): a socket in the process's place served by
// someone else is refused.
func TestDialChecksListener(t *testing.T) {
	tg := vramtest.Start(t)
	dir := t.TempDir()
	l, err := net.Listen("unix", preloadctl.Socket(dir, tg.PID))
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
	_, err = preloadctl.Dial(context.Background(), dir, tg.PID)
	if !errors.Is(err, preloadctl.ErrNotTheProcess) || !strings.Contains(err.Error(), "served by process "+strconv.Itoa(os.Getpid())) {
		t.Fatalf("dial a stranger's socket: %v, want %v", err, preloadctl.ErrNotTheProcess)
	}
	if _, err := preloadctl.Dial(context.Background(), tg.SockDir, tg.PID); err != nil {
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
	tg := vramtest.Start(t, "GPUCR_PRELOAD_DIR="+link)
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
	tg := vramtest.Start(t, "GPUCR_PRELOAD_IDLE_MS=300")
	c, err := net.Dial("unix", preloadctl.Socket(tg.SockDir, tg.PID))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	time.Sleep(50 * time.Millisecond) // accepted first
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(5*time.Second))
	defer cancel()
	p, err := preloadctl.Dial(ctx, tg.SockDir, tg.PID)
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
	tg := vramtest.Start(t)
	victimDir := t.TempDir()
	victim := filepath.Join(victimDir, "precious")
	if err := os.WriteFile(victim, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := preloadctl.Dial(ctx, tg.SockDir, tg.PID)
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
	tg.MustBeIntact(t)
	if _, err := os.Stat(victim); err != nil {
		t.Fatalf("the file handed over as the kept copy: %v, want it in place", err)
	}
}
