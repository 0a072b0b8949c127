package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/preloadctl"
	"golang.org/x/sys/unix"
)

// Issue 25: root checkpoints the CUDA program of another user, whose
// GPUCR_PRELOAD_DIR that user owns, while that user attacks: it swaps
// what it owns for symlinks to root's files and directories, and has its
// process name root's files as its kept copy. Root creates nothing in the
// user's directory, truncates, empties, unmounts and opens none of root's
// files, and the program comes back intact.

const nobody = 65534

// userTarget is a target run as nobody, with a socket directory it owns.
type userTarget struct {
	pid                 int
	tdir, home, sockDir string
}

// startUser runs the target as nobody (setpriv) with the library
// preloaded and GPUCR_PRELOAD_DIR in a directory nobody owns.
func (e *fastEnv) startUser(t *testing.T, name string) userTarget {
	t.Helper()
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		missing(t, "setpriv (util-linux) runs the target as another user")
	}
	if os.Geteuid() != 0 {
		missing(t, "root checkpoints another user's process: the test needs root")
	}
	u := userTarget{tdir: filepath.Join(e.dir, name), home: filepath.Join(e.dir, name+"-home")}
	u.sockDir = filepath.Join(u.home, "run")
	// The user reaches its program, the library and the fake driver (all
	// in e.dir), and owns its own directories.
	lib := filepath.Join(e.dir, "lib", preloadctl.Library)
	b, err := os.ReadFile(filepath.Join(filepath.Dir(e.gcs), preloadctl.Library))
	if err == nil {
		err = os.WriteFile(lib, b, 0o755)
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{e.dir, e.cudaState} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range []string{u.tdir, u.home} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(d, nobody, nobody); err != nil {
			t.Fatal(err)
		}
	}
	out, err := os.Create(filepath.Join(u.tdir, "out"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	cmd := exec.Command(setpriv, "--reuid="+strconv.Itoa(nobody), "--regid="+strconv.Itoa(nobody), "--clear-groups",
		"/usr/bin/env", "LD_PRELOAD="+lib, e.target, u.tdir)
	cmd.Env = append(e.env(), "GPUCR_PRELOAD_DIR="+u.sockDir)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-done })
	for end := time.Now().Add(10 * time.Second); !fileExists(filepath.Join(u.tdir, "ready")); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(end) {
			b, _ := os.ReadFile(out.Name())
			t.Fatalf("target not ready: %s", b)
		}
	}
	u.pid = cmd.Process.Pid
	return u
}

// rootOnly makes a directory of root's (0700) holding a file, on a tmpfs
// of its own: what the attacks aim at.
func rootOnly(t *testing.T, names ...string) string {
	t.Helper()
	d := filepath.Join(t.TempDir(), "root-only")
	if err := os.Mkdir(d, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("victim", d, "tmpfs", 0, "size=1m,mode=0700"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(d, unix.MNT_DETACH) })
	for _, n := range names {
		if err := os.WriteFile(filepath.Join(d, n), []byte("root's"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return d
}

func mustBeUntouched(t *testing.T, d string, names ...string) {
	t.Helper()
	for _, n := range names {
		if b, err := os.ReadFile(filepath.Join(d, n)); err != nil || string(b) != "root's" {
			t.Errorf("root's file %s: %q %v, want it untouched", n, b, err)
		}
	}
	if mi, _ := os.ReadFile("/proc/self/mountinfo"); !strings.Contains(string(mi), " "+d+" ") {
		t.Errorf("root's mount %s was unmounted", d)
	}
}

// TestFastPathOtherUser (issue 25 H1, H2): root runs `gpu suspend --to` and
// `gpu resume --from` on a program of nobody's, whose socket directory
// nobody owns. The user watches its directory and, as soon as anything
// of root's appears there, swaps the directory for one whose entries are
// symlinks to a directory of root's (the old kept copy went there: root
// truncated root's file through them, emptied the directory and
// unmounted it). Nothing of root's appears there now; root's files and
// mount are untouched, and the program comes back.
func TestFastPathOtherUser(t *testing.T) {
	e := setupFast(t)
	ctx := testCtx(t)
	u := e.startUser(t, "u")
	names := []string{}
	for k := range 3 {
		names = append(names, "vram-"+strconv.Itoa(u.pid)+"-0"+strconv.Itoa(k)+".bin")
	}
	victim := rootOnly(t, names...)
	// The attacker: what root makes in the user's directory is swapped.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var seen []string
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			ents, _ := os.ReadDir(u.sockDir)
			for _, en := range ents {
				if strings.HasPrefix(en.Name(), "preload-") {
					continue
				}
				seen = append(seen, en.Name())
				old := u.sockDir + ".old"
				if os.Rename(u.sockDir, old) == nil && os.Mkdir(u.sockDir, 0o700) == nil {
					os.Chown(u.sockDir, nobody, nobody)
					os.Symlink(victim, filepath.Join(u.sockDir, en.Name()))
					// The program's socket stays reachable.
					os.Symlink(filepath.Join(old, "preload-"+strconv.Itoa(u.pid)+".sock"), filepath.Join(u.sockDir, "preload-"+strconv.Itoa(u.pid)+".sock"))
				}
				return
			}
			time.Sleep(time.Millisecond)
		}
	}()
	ar := filepath.Join(e.dir, "ar-user")
	env := []string{"GPUCR_PRELOAD_DIR=" + u.sockDir}
	out, err := e.gcsRunEnv(ctx, env, "gpu", "suspend", "--pid", strconv.Itoa(u.pid), "--to", ar, "--json", "--vram-files", "3")
	close(stop)
	wg.Wait()
	if len(seen) != 0 {
		t.Errorf("root made %v in the user's directory %s", seen, u.sockDir)
	}
	mustBeUntouched(t, victim, names...)
	if err != nil {
		t.Fatal(err)
	}
	var ph phases
	if json.Unmarshal(out, &ph) != nil || !ph.has("vram copy out") {
		t.Fatalf("suspend took no fast path: %s", out)
	}
	if r := fastCheck(t, u.tdir, 300*time.Millisecond); r != "" {
		t.Fatalf("a suspended process answered: %q", r)
	}
	if _, err := e.gcsRunEnv(ctx, env, "gpu", "resume", "--pid", strconv.Itoa(u.pid), "--from", ar, "--json"); err != nil {
		t.Fatal(err)
	}
	if r := fastCheck(t, u.tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
		t.Fatalf("after resume: %q", r)
	}
}

// TestFastPathOtherUserKept (issue 25 H3): nobody's program is parked with
// its memory released and names, as its kept copy, paths its user then
// points at a file of root's (its user may make it say anything: here a
// client of its socket hands over its own files and swaps them). `gpu
// resume --pid` restores the driver's state and refuses to refill from
// a copy gpucr-stream did not keep: it never opens root's file (watched
// with inotify). The program stays parked, and comes back from its own
// copy.
func TestFastPathOtherUserKept(t *testing.T) {
	e := setupFast(t)
	ctx := testCtx(t)
	u := e.startUser(t, "k")
	secretDir := rootOnly(t, "secret")
	secret := filepath.Join(secretDir, "secret")
	in, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(in)
	if _, err := unix.InotifyAddWatch(in, secret, unix.IN_OPEN); err != nil {
		t.Fatal(err)
	}
	// The user's client: park, copy out into its own files, keep, release,
	// announce the driver, detach.
	p, err := preloadctl.Dial(ctx, u.sockDir, u.pid)
	if err != nil {
		t.Fatal(err)
	}
	own := filepath.Join(u.home, "copy")
	if err := os.Mkdir(own, 0o700); err != nil {
		t.Fatal(err)
	}
	var ws, rs []*os.File
	for k := range 2 {
		w, err := os.Create(filepath.Join(own, strconv.Itoa(k)))
		if err != nil {
			t.Fatal(err)
		}
		ws = append(ws, w)
	}
	step := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	step("park", p.Park(ctx, 5*time.Second))
	_, err = p.CopyOut(ctx, ws)
	step("copy out", err)
	for _, w := range ws {
		r, err := os.Open(w.Name())
		step("open", err)
		rs = append(rs, r)
		w.Close()
	}
	d, err := os.Open(own)
	step("open", err)
	step("keep", p.Keep(ctx, d, rs))
	d.Close()
	step("release", p.Release(ctx))
	step("driver", p.Driver(ctx))
	step("detach", p.Detach(ctx))
	p.Close()
	// The driver's lock and checkpoint, by root, as a checkpoint does.
	env := []string{"GPUCR_PRELOAD_DIR=" + u.sockDir}
	if _, err := e.gcsRunEnv(ctx, env, "gpu", "suspend", "--pid", strconv.Itoa(u.pid), "--json"); err != nil {
		t.Fatal(err)
	}
	// The user points the kept paths at root's file.
	for _, r := range rs {
		step("hide", os.Rename(r.Name(), r.Name()+".mine"))
		step("symlink", os.Symlink(secret, r.Name()))
	}
	_, err = e.gcsRunEnv(ctx, env, "gpu", "resume", "--pid", strconv.Itoa(u.pid), "--json")
	if err == nil || !strings.Contains(err.Error(), "kept no copy") {
		t.Errorf("gpu resume --pid on a copy gpucr-stream did not keep: %v", err)
	}
	var buf [4096]byte
	if n, _ := unix.Read(in, buf[:]); n > 0 {
		t.Errorf("root opened %s, a file the process named", secret)
	}
	if r := fastCheck(t, u.tdir, 300*time.Millisecond); r != "" {
		t.Fatalf("the program ran: %q", r)
	}
	// Its own copy brings it back (the driver's state is back already).
	p, err = preloadctl.Dial(ctx, u.sockDir, u.pid)
	step("dial", err)
	defer p.Close()
	var mine []*os.File
	for _, r := range rs {
		r.Close()
		f, err := os.Open(r.Name() + ".mine")
		step("open", err)
		defer f.Close()
		mine = append(mine, f)
	}
	step("recover", p.Recover(context.WithoutCancel(ctx), mine))
	if r := fastCheck(t, u.tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
		t.Fatalf("after recover: %q", r)
	}
}
