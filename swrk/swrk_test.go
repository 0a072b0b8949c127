package swrk

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/gpucr/gpucr-stream/criusock"
)

// fakeCRIU stands in for CRIU's command line: it records its arguments,
// runs its action scripts for $FAKE_ACTIONS (the root task's PID 4242),
// checks that descriptor $FAKE_FD is open, records $FAKE_CGROUP's
// cgroup.events as it starts, exits $FAKE_EXIT where set, writes
// --pidfile, and fails as CRIU does when a script fails.
const fakeCRIU = `#!/bin/sh
printf '%s\n' "$@" > "$FAKE_DIR/args"
scripts=""; pidfile=""
for a; do
	case "$a" in
	--action-script=*) scripts="$scripts ${a#--action-script=}" ;;
	--pidfile=*) pidfile="${a#--pidfile=}" ;;
	esac
done
[ -z "$FAKE_FD" ] || [ -e "/proc/self/fd/$FAKE_FD" ] || { echo "fd $FAKE_FD not inherited" > "$FAKE_DIR/fd"; exit 1; }
[ -z "$FAKE_CGROUP" ] || cat "$FAKE_CGROUP/cgroup.events" > "$FAKE_DIR/events"
[ -z "$FAKE_EXIT" ] || exit "$FAKE_EXIT"
for act in $FAKE_ACTIONS; do
	for s in $scripts; do
		CRTOOLS_SCRIPT_ACTION=$act CRTOOLS_INIT_PID=4242 "$s" || { echo "Error (criu/fake.c): $act failed" >> "$FAKE_DIR/criu.log"; exit 1; }
	done
done
[ -z "$pidfile" ] || echo 4242 > "$pidfile"
`

// rpcPeer is the runtime's end of a swrk session, in this process.
type rpcPeer struct {
	t      *testing.T
	conn   *net.UnixConn
	served chan error
}

// startSwrk runs Serve on one end of a SOCK_SEQPACKET pair, as runc does
// with `criu swrk 3`, and sends req on the other.
func startSwrk(t *testing.T, req *rpc.CriuReq) *rpcPeer {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fds[0]), "runtime end")
	c, err := net.FileConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	r := &rpcPeer{t: t, conn: c.(*net.UnixConn), served: make(chan error, 1)}
	t.Cleanup(func() { r.conn.Close() })
	b, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.conn.Write(b); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	served := make(chan error, 1)
	go func() { served <- Serve(ctx, fds[1]) }()
	// Garbage collections all along: a descriptor of the session left to
	// a File's finalizer was closed under Serve (runc saw "work dir: bad
	// file descriptor" on a loaded machine).
	go func() {
		for {
			select {
			case err := <-served:
				r.served <- err
				return
			case <-time.After(time.Millisecond):
				runtime.GC()
			}
		}
	}()
	return r
}

func (r *rpcPeer) read() *rpc.CriuResp {
	r.t.Helper()
	buf := make([]byte, 1<<16)
	n, err := r.conn.Read(buf)
	if err != nil {
		r.t.Fatal(err)
	}
	resp := &rpc.CriuResp{}
	if err := proto.Unmarshal(buf[:n], resp); err != nil {
		r.t.Fatal(err)
	}
	return resp
}

func (r *rpcPeer) answer(ok bool) {
	r.t.Helper()
	b, _ := proto.Marshal(&rpc.CriuReq{Type: rpc.CriuReqType_NOTIFY.Enum(), NotifySuccess: proto.Bool(ok)})
	if _, err := r.conn.Write(b); err != nil {
		r.t.Fatal(err)
	}
}

// streamerDir is an images dir where a streamer listens (sock), with the
// fake CRIU named in its settings, and the descriptor the request names.
func streamerDir(t *testing.T, sock string) (dir string, fd int32) {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "swrk-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	l, err := net.Listen("unix", filepath.Join(dir, sock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	criu := filepath.Join(dir, "fake-criu")
	if err := os.WriteFile(criu, []byte(fakeCRIU), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := WriteSettings(dir, Settings{CRIU: criu, Args: []string{"--ghost-limit", "9M"}}); err != nil {
		t.Fatal(err)
	}
	d, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	t.Setenv("FAKE_DIR", dir)
	return dir, int32(d.Fd())
}

// TestServeDump: a runc-shaped dump into a dir where a streamer listens
// runs CRIU's command line with --stream and the request's options, each
// action reaches the runtime as a NOTIFY (no PID but where CRIU's RPC
// gives one), and the answer is a successful DUMP.
func TestServeDump(t *testing.T) {
	dir, fd := streamerDir(t, criusock.CaptureSocket)
	t.Setenv("FAKE_ACTIONS", "pre-dump network-lock post-dump")
	o := runcDump()
	o.ImagesDirFd, o.WorkDirFd, o.ConfigFile = proto.Int32(fd), nil, nil
	r := startSwrk(t, &rpc.CriuReq{Type: rpc.CriuReqType_DUMP.Enum(), Opts: o})
	for _, want := range []string{"pre-dump", "network-lock", "post-dump"} {
		resp := r.read()
		if resp.GetType() != rpc.CriuReqType_NOTIFY || resp.GetNotify().GetScript() != want || resp.GetNotify().Pid != nil {
			t.Fatalf("got %v, want a NOTIFY of %s without a PID", resp, want)
		}
		r.answer(true)
	}
	resp := r.read()
	if resp.GetType() != rpc.CriuReqType_DUMP || !resp.GetSuccess() || resp.GetDump().GetRestored() {
		t.Fatalf("answer %v", resp)
	}
	if err := <-r.served; err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(filepath.Join(dir, "args"))
	args := strings.Split(strings.TrimSpace(string(b)), "\n")
	if args[0] != "dump" || !slices.Contains(args, "--stream") || !slices.Contains(args, "--tree=1234") ||
		!slices.Contains(args, "--ghost-limit") || !slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, "--images-dir=/proc/") }) {
		t.Errorf("criu's arguments: %q", args)
	}
}

// TestServeRestore: a restore gets post-restore with the restored PID,
// the descriptors the request names at their numbers, and the PID in its
// answer.
func TestServeRestore(t *testing.T) {
	dir, fd := streamerDir(t, criusock.ServeSocket)
	t.Setenv("FAKE_ACTIONS", "setup-namespaces post-restore")
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Close()
	defer pw.Close()
	t.Setenv("FAKE_FD", "63")
	if err := unix.Dup2(int(pr.Fd()), 63); err != nil { // CRIU expects it there
		t.Fatal(err)
	}
	defer unix.Close(63)
	o := runcRestore()
	o.ImagesDirFd, o.InheritFd = proto.Int32(fd), []*rpc.InheritFd{{Key: proto.String("extRootNetNS"), Fd: proto.Int32(63)}}
	o.WorkDirFd = proto.Int32(fd) // the images dir again: CRIU's logs go there
	r := startSwrk(t, &rpc.CriuReq{Type: rpc.CriuReqType_RESTORE.Enum(), Opts: o})
	for _, want := range []string{"setup-namespaces", "post-restore"} {
		resp := r.read()
		if resp.GetNotify().GetScript() != want || resp.GetNotify().GetPid() != 4242 {
			t.Fatalf("got %v, want %s with PID 4242", resp, want)
		}
		r.answer(true)
	}
	resp := r.read()
	if resp.GetType() != rpc.CriuReqType_RESTORE || !resp.GetSuccess() || resp.GetRestore().GetPid() != 4242 {
		t.Fatalf("answer %v", resp)
	}
	if err := <-r.served; err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(filepath.Join(dir, "args"))
	for _, want := range []string{"restore", "--restore-detached", "--restore-sibling", "--inherit-fd=fd[63]:extRootNetNS"} {
		if !strings.Contains(string(b), want+"\n") {
			t.Errorf("criu's arguments lack %s: %s", want, b)
		}
	}
}

// TestServeRuntimeFails: a runtime that fails a notification fails CRIU's
// step; the answer is a failure carrying CRIU's first error line, and the
// log says why.
func TestServeRuntimeFails(t *testing.T) {
	dir, fd := streamerDir(t, criusock.CaptureSocket)
	t.Setenv("FAKE_ACTIONS", "network-lock post-dump")
	o := runcDump()
	o.ImagesDirFd, o.WorkDirFd, o.ConfigFile, o.LogFile = proto.Int32(fd), nil, nil, proto.String("criu.log")
	r := startSwrk(t, &rpc.CriuReq{Type: rpc.CriuReqType_DUMP.Enum(), Opts: o})
	if resp := r.read(); resp.GetNotify().GetScript() != "network-lock" {
		t.Fatalf("got %v", resp)
	}
	r.answer(false)
	resp := r.read()
	if resp.GetType() != rpc.CriuReqType_DUMP || resp.GetSuccess() || !strings.Contains(resp.GetCrErrmsg(), "network-lock failed") {
		t.Fatalf("answer %v, want a failure with CRIU's error line", resp)
	}
	if err := <-r.served; err == nil {
		t.Fatal("Serve succeeded")
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "criu.log")); !strings.Contains(string(b), "gpucr-stream swrk") {
		t.Errorf("log: %s", b)
	}
}

// TestServeRefuses: an option stream mode cannot honour is answered as a
// failure naming it, before CRIU runs.
func TestServeRefuses(t *testing.T) {
	dir, fd := streamerDir(t, criusock.CaptureSocket)
	o := runcDump()
	o.ImagesDirFd, o.WorkDirFd, o.ConfigFile, o.AutoDedup = proto.Int32(fd), nil, nil, proto.Bool(true)
	r := startSwrk(t, &rpc.CriuReq{Type: rpc.CriuReqType_DUMP.Enum(), Opts: o})
	resp := r.read()
	if resp.GetSuccess() || !strings.Contains(resp.GetCrErrmsg(), "auto_dedup") {
		t.Fatalf("answer %v", resp)
	}
	if err := <-r.served; err == nil || !strings.Contains(err.Error(), "auto_dedup") {
		t.Fatalf("Serve: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "args")); err == nil {
		t.Error("criu ran")
	}
}

// TestStreamedCall: only a dump or restore into a dir where a streamer
// listens (directly or through a symlink, whose target's directory holds
// the settings) is streamed; the rest goes to the real CRIU.
func TestStreamedCall(t *testing.T) {
	dir, fd := streamerDir(t, criusock.CaptureSocket)
	plain := t.TempDir()
	p, err := os.Open(plain)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	linked := t.TempDir()
	if err := os.Symlink(filepath.Join(dir, criusock.CaptureSocket), filepath.Join(linked, criusock.CaptureSocket)); err != nil {
		t.Fatal(err)
	}
	l, err := os.Open(linked)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	for _, tc := range []struct {
		name      string
		typ       rpc.CriuReqType
		images    int32
		streamDir string // "": not streamed
	}{
		{"dump, streamer", rpc.CriuReqType_DUMP, fd, dir},
		{"dump, symlink", rpc.CriuReqType_DUMP, int32(l.Fd()), dir},
		{"dump, plain dir", rpc.CriuReqType_DUMP, int32(p.Fd()), ""},
		{"restore, capture socket only", rpc.CriuReqType_RESTORE, fd, ""},
		{"pre-dump", rpc.CriuReqType_PRE_DUMP, fd, ""},
		{"version", rpc.CriuReqType_VERSION, fd, ""},
		{"check", rpc.CriuReqType_CHECK, fd, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := streamedCall(&rpc.CriuReq{Type: tc.typ.Enum(), Opts: &rpc.CriuOpts{ImagesDirFd: proto.Int32(tc.images)}}, fds[1])
			if err != nil {
				t.Fatal(err)
			}
			switch {
			case tc.streamDir == "" && c != nil:
				t.Fatalf("streamed (%s)", c.streamDir)
			case tc.streamDir != "" && c == nil:
				t.Fatal("not streamed")
			case c != nil && c.streamDir != tc.streamDir:
				t.Fatalf("settings from %s, want %s", c.streamDir, tc.streamDir)
			}
			if c != nil {
				c.images.Close()
			}
		})
	}
}

// TestSettingsTrusted: settings that another user could have written are
// refused.
func TestSettingsTrusted(t *testing.T) {
	dir := t.TempDir()
	if err := WriteSettings(dir, Settings{CRIU: "/x"}); err != nil {
		t.Fatal(err)
	}
	if s, err := readSettings(dir); err != nil || s.CRIU != "/x" {
		t.Fatalf("%+v, %v", s, err)
	}
	if err := os.Chmod(filepath.Join(dir, SettingsFile), 0o666); err != nil {
		t.Fatal(err)
	}
	if _, err := readSettings(dir); err == nil {
		t.Fatal("world-writable settings taken")
	}
	if s, err := readSettings(t.TempDir()); err != nil || s.CRIU != "" {
		t.Fatalf("no settings: %+v, %v", s, err)
	}
}

// fakeCommitter answers criusock.AskCommit on FIFOs in a new directory
// with answer, once, and says when it was asked.
func fakeCommitter(t *testing.T, answer string) (dir string, asked <-chan struct{}) {
	t.Helper()
	dir = t.TempDir()
	var files [2]*os.File
	for i, n := range []string{"commit.req", "commit.res"} {
		if err := unix.Mkfifo(filepath.Join(dir, n), 0o600); err != nil {
			t.Fatal(err)
		}
		f, err := os.OpenFile(filepath.Join(dir, n), os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		files[i] = f
	}
	ch := make(chan struct{})
	go func() {
		b := make([]byte, 64)
		if n, err := files[0].Read(b); err == nil && strings.TrimSpace(string(b[:n])) == "post-dump" {
			close(ch)
			files[1].WriteString(answer + "\n")
		}
	}()
	return dir, ch
}

// TestServeCommit: with a committer in the settings, post-dump is
// committed before the runtime hears of it; a refused commit fails CRIU's
// step, and the runtime never hears of post-dump.
func TestServeCommit(t *testing.T) {
	for _, tc := range []struct{ answer string }{{"ok"}, {"the bucket is full"}} {
		t.Run(tc.answer, func(t *testing.T) {
			dir, fd := streamerDir(t, criusock.CaptureSocket)
			commit, asked := fakeCommitter(t, tc.answer)
			b, _ := os.ReadFile(filepath.Join(dir, SettingsFile))
			var s Settings
			json.Unmarshal(b, &s)
			s.Commit = commit
			if err := WriteSettings(dir, s); err != nil {
				t.Fatal(err)
			}
			t.Setenv("FAKE_ACTIONS", "pre-dump post-dump")
			o := runcDump()
			o.ImagesDirFd, o.WorkDirFd, o.ConfigFile = proto.Int32(fd), nil, nil
			r := startSwrk(t, &rpc.CriuReq{Type: rpc.CriuReqType_DUMP.Enum(), Opts: o})
			if resp := r.read(); resp.GetNotify().GetScript() != "pre-dump" {
				t.Fatalf("got %v", resp)
			}
			r.answer(true)
			resp := r.read()
			select {
			case <-asked:
			default:
				t.Fatalf("%v reached the runtime before the commit was asked for", resp)
			}
			if tc.answer == "ok" {
				if resp.GetNotify().GetScript() != "post-dump" {
					t.Fatalf("got %v, want post-dump", resp)
				}
				r.answer(true)
				resp = r.read()
			}
			if resp.GetType() != rpc.CriuReqType_DUMP || resp.GetSuccess() != (tc.answer == "ok") {
				t.Fatalf("answer %v", resp)
			}
			if err := <-r.served; (err == nil) != (tc.answer == "ok") {
				t.Fatalf("Serve: %v", err)
			}
		})
	}
}

func TestParseFD(t *testing.T) {
	for _, c := range []struct {
		arg  string
		want int // 0: refused
	}{{"3", 3}, {"17", 17}, {"2", 0}, {"0", 0}, {"-1", 0}, {"x", 0}, {"", 0}} {
		fd, err := ParseFD(c.arg)
		if fd != c.want || (err != nil) != (c.want == 0) {
			t.Errorf("ParseFD(%q) = %d, %v; want %d", c.arg, fd, err, c.want)
		}
	}
}
