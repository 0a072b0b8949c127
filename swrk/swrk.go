// Package swrk is a criu-compatible entry point for container runtimes.
// runc and crun drive CRIU over its RPC protocol (`criu swrk FD`: one
// criu_req per SOCK_SEQPACKET message, answered by criu_resp), and CRIU
// 4.2's RPC path cannot stream: with `stream` set it opens the images dir
// with mode -1 and reaches a BUG() (cr-service.c, setup_images_and_workdir).
// Pointed at gpucr-stream (`runc --criu gpucr-stream`, which runs
// `gpucr-stream swrk 3`), a dump or restore whose images dir holds a
// streamer socket (streamer-capture.sock, streamer-serve.sock, or a
// symlink to one) runs CRIU's command line in --stream mode instead: the
// request's options become command-line options (args.go), CRIU's action
// scripts become the NOTIFY messages the runtime answers (notify.go),
// descriptors the request names keep their numbers, and the answer is the
// one CRIU's RPC gives; a dump's cgroup v2 is frozen before CRIU starts
// (freeze.go). A VERSION request is answered here where
// gpucr-stream, driving the runtime, said criu's answer (version.go).
// Every other request (check, feature-check, version, pre-dump, a dump
// into a plain directory) goes to the real CRIU's swrk, which this
// process becomes (exec) with the socket untouched.
package swrk

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/gpucr/gpucr-stream/criusock"
)

// maxMessage bounds one RPC message: runc's largest (a restore listing
// every mount of a container) is a few KiB.
const maxMessage = 4 << 20

// Serve answers the CRIU RPC session on descriptor fd, as `criu swrk fd`
// does. It returns once the request is answered (an error: it failed,
// and the runtime was told); a request it does not stream never returns:
// the process becomes the real CRIU.
func Serve(ctx context.Context, fd int) error {
	req, err := nextRequest(fd)
	if err != nil {
		return fmt.Errorf("swrk: %w", err)
	}
	if req == nil {
		return nil // the runtime asked for the version alone
	}
	c, err := streamedCall(req, fd)
	if err != nil {
		return fmt.Errorf("swrk: %w", err)
	}
	if c == nil {
		return passThrough(fd)
	}
	defer c.close()
	return c.run(ctx)
}

// ParseFD is the descriptor of `criu swrk FD`: a number of at least 3
// (0-2 are the standard streams).
func ParseFD(arg string) (int, error) {
	fd, err := strconv.Atoi(arg)
	if err != nil || fd < 3 {
		return 0, fmt.Errorf("descriptor %q: want a number of at least 3", arg)
	}
	return fd, nil
}

// errClosed: the runtime closed the session.
var errClosed = errors.New("the runtime closed the connection")

// peekRequest reads the next request without taking it off the socket,
// so that the real CRIU can still read it.
func peekRequest(fd int) (*rpc.CriuReq, error) {
	n, _, err := unix.Recvfrom(fd, nil, unix.MSG_PEEK|unix.MSG_TRUNC)
	if err != nil {
		return nil, fmt.Errorf("read request on descriptor %d: %w", fd, err)
	}
	if n == 0 {
		return nil, fmt.Errorf("descriptor %d: %w", fd, errClosed)
	}
	if n < 0 || n > maxMessage {
		return nil, fmt.Errorf("request of %d bytes on descriptor %d (want 1..%d)", n, fd, maxMessage)
	}
	buf := make([]byte, n)
	if n, _, err = unix.Recvfrom(fd, buf, unix.MSG_PEEK); err != nil {
		return nil, fmt.Errorf("read request on descriptor %d: %w", fd, err)
	}
	req := &rpc.CriuReq{}
	if err := proto.Unmarshal(buf[:n], req); err != nil {
		return nil, fmt.Errorf("request on descriptor %d: %w", fd, err)
	}
	return req, nil
}

// dropRequest takes the request peekRequest read off the socket.
func dropRequest(fd int) error {
	if _, _, err := unix.Recvfrom(fd, nil, unix.MSG_TRUNC); err != nil {
		return fmt.Errorf("read request on descriptor %d: %w", fd, err)
	}
	return nil
}

// passThrough becomes the real CRIU's swrk on the same socket.
func passThrough(fd int) error {
	return ExecCRIU([]string{"swrk", strconv.Itoa(fd)})
}

// ExecCRIU becomes the real criu (on PATH, never this program) with args:
// what gpucr-stream installed as `criu` does with a command line that is
// not `swrk` (a runtime's `criu check`, `criu --version`). It returns only
// on failure.
func ExecCRIU(args []string) error {
	criu, err := criusock.FindCRIU("")
	if err != nil {
		return fmt.Errorf("swrk: %w", err)
	}
	err = syscall.Exec(criu, append([]string{criu}, args...), os.Environ())
	return fmt.Errorf("swrk: exec %s: %w", criu, err)
}

// call is one streamed dump or restore.
type call struct {
	req    *rpc.CriuReq
	opts   *rpc.CriuOpts
	fd     int
	peer   int // the caller, whose descriptors the request names
	conn   *net.UnixConn
	mu     sync.Mutex // one exchange at a time on conn
	images *os.File   // the images dir, held open: CRIU reaches it by /proc/PID/fd/N
	work   *os.File   // the work dir, if the request names one
	// streamDir holds the streamer socket itself (a symlink in images
	// may point there) and the settings.
	streamDir string
	mode      string // "dump" or "restore"
	commit    string // a committer to ask at post-dump (Settings.Commit)
	buf       []byte // receive's
}

// streamedCall is the call for req when it is a dump or restore into an
// images dir where a streamer listens, else nil.
func streamedCall(req *rpc.CriuReq, fd int) (*call, error) {
	mode, sock := "", ""
	switch req.GetType() {
	case rpc.CriuReqType_DUMP:
		mode, sock = "dump", criusock.CaptureSocket
	case rpc.CriuReqType_RESTORE:
		mode, sock = "restore", criusock.ServeSocket
	default:
		return nil, nil
	}
	opts := requestOpts(req)
	// The caller's descriptors are reached through /proc, as CRIU does.
	cred, err := unix.GetsockoptUcred(fd, unix.SOL_SOCKET, unix.SO_PEERCRED)
	if err != nil {
		return nil, fmt.Errorf("the caller of descriptor %d: %w", fd, err)
	}
	path := opts.GetImagesDir()
	if opts.GetImagesDirFd() >= 0 {
		path = fmt.Sprintf("/proc/%d/fd/%d", cred.Pid, opts.GetImagesDirFd())
	}
	if path == "" {
		return nil, nil // the real CRIU says what is missing
	}
	images, err := openDir(path)
	if err != nil {
		return nil, nil // likewise
	}
	var st unix.Stat_t
	if unix.Fstatat(int(images.Fd()), sock, &st, 0) != nil || st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		images.Close()
		return nil, nil // a plain checkpoint: no streamer listens there
	}
	real, err := filepath.EvalSymlinks(fdPath(os.Getpid(), images) + "/" + sock)
	if err != nil {
		images.Close()
		return nil, fmt.Errorf("streamer socket in %s: %w", path, err)
	}
	return &call{req: req, opts: opts, fd: fd, peer: int(cred.Pid), images: images, streamDir: filepath.Dir(real), mode: mode}, nil
}

func openDir(path string) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	return os.NewFile(uintptr(fd), path), nil
}

// fdPath is /proc/PID/fd/N of f, a path to it for any process.
func fdPath(pid int, f *os.File) string {
	return "/proc/" + strconv.Itoa(pid) + "/fd/" + strconv.Itoa(int(f.Fd()))
}

func (c *call) close() {
	if c.conn != nil {
		c.conn.Close()
	}
	c.images.Close()
	if c.work != nil {
		c.work.Close()
	}
}

// run takes the request off the socket, runs CRIU and answers.
func (c *call) run(ctx context.Context) error {
	// FileConn works on a duplicate; the descriptor itself is closed here,
	// not whenever the garbage collector finalizes its File.
	f := os.NewFile(uintptr(c.fd), "criu rpc")
	conn, err := net.FileConn(f)
	f.Close()
	if err != nil {
		return fmt.Errorf("swrk: descriptor %d: %w", c.fd, err)
	}
	c.conn = conn.(*net.UnixConn)
	if _, err := c.receive(); err != nil { // the request peeked at
		return fmt.Errorf("swrk: %w", err)
	}
	if c.opts.WorkDirFd != nil {
		if c.work, err = openDir(fmt.Sprintf("/proc/%d/fd/%d", c.peer, c.opts.GetWorkDirFd())); err != nil {
			return c.fail(fmt.Errorf("work dir: %w", err))
		}
	}
	settings, err := readSettings(c.streamDir)
	if err != nil {
		return c.fail(err)
	}
	c.commit = settings.Commit
	tr, err := translate(c.req.GetType(), c.opts)
	if err != nil {
		return c.fail(err)
	}
	freeze := "" // a restore is not frozen
	if c.mode == "dump" {
		freeze = c.opts.GetFreezeCgroup()
	}
	thaw := freezeAhead(ctx, freeze)
	pid, err := c.runCRIU(ctx, settings, tr)
	if terr := thaw(); err == nil {
		err = terr
	}
	if err != nil {
		return c.fail(err)
	}
	resp := &rpc.CriuResp{Type: c.req.Type, Success: proto.Bool(true)}
	if c.mode == "dump" {
		resp.Dump = &rpc.CriuDumpResp{Restored: proto.Bool(false)}
	} else {
		resp.Restore = &rpc.CriuRestoreResp{Pid: proto.Int32(int32(pid))}
	}
	if err := c.send(resp); err != nil {
		return fmt.Errorf("swrk: answer: %w", err)
	}
	return nil
}

// runCRIU runs CRIU's command line for the call and returns the restored
// root's PID (restore).
func (c *call) runCRIU(ctx context.Context, s Settings, tr *translation) (int, error) {
	criu, err := criusock.FindCRIU(s.CRIU)
	if err != nil {
		return 0, err
	}
	var conf map[string]bool
	var confArgs []string
	if f := c.opts.GetConfigFile(); f != "" {
		// A missing file is ignored, as CRIU's RPC ignores it.
		if conf, err = configOptions(f); err == nil {
			confArgs = []string{"--config=" + f}
		} else if !errors.Is(err, os.ErrNotExist) {
			return 0, fmt.Errorf("config file: %w", err)
		}
	}
	args := append([]string{c.mode}, confArgs...)
	args = append(args, tr.args(conf)...)
	var r *relay
	if c.opts.GetNotifyScripts() || c.commit != "" {
		if r, err = newRelay(); err != nil {
			return 0, err
		}
		defer r.close()
		args = append(args, "--action-script="+r.script())
	}
	args = append(args, s.Args...)
	self := os.Getpid()
	args = append(args, "--stream", "--images-dir="+fdPath(self, c.images))
	if c.work != nil {
		args = append(args, "--work-dir="+fdPath(self, c.work))
	}
	pidfile := ""
	if c.mode == "restore" {
		pidDir, err := os.MkdirTemp("", "gpucr-swrk-pid-")
		if err != nil {
			return 0, err
		}
		defer os.RemoveAll(pidDir)
		pidfile = filepath.Join(pidDir, "pid")
		// Over RPC a restore is always detached (restore_using_req).
		args = append(args, "--restore-detached", "--pidfile="+pidfile)
	}
	if len(tr.execCmd) > 0 {
		args = append(append(args, "--exec-cmd", "--"), tr.execCmd...)
	}
	cmd := exec.Command(criu, args...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	if cmd.ExtraFiles, err = inherited(tr.inherit); err != nil {
		return 0, err
	}
	err = cmd.Start()
	closeAll(cmd.ExtraFiles)
	if err != nil {
		return 0, fmt.Errorf("start %s: %w", criu, err)
	}
	var wg sync.WaitGroup
	if r != nil {
		rctx, stop := context.WithCancel(ctx)
		defer stop()
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.serve(rctx, c.notify)
		}()
		defer func() { stop(); wg.Wait() }()
	}
	err = cmd.Wait()
	if err != nil {
		return 0, fmt.Errorf("criu %s --stream: %w", c.mode, err)
	}
	if pidfile == "" {
		return 0, nil
	}
	pid := criusock.ReadPID(pidfile)
	if pid <= 0 {
		return 0, fmt.Errorf("criu restore wrote no PID to %s", pidfile)
	}
	return pid, nil
}

// inherited places descriptors at their own numbers in a child: entry
// i of ExtraFiles is descriptor 3+i, and nil entries are closed there.
// The entries are duplicates, owned here: close them once the child runs.
func inherited(fds []int) ([]*os.File, error) {
	top := 2
	for _, fd := range fds {
		top = max(top, fd)
	}
	files := make([]*os.File, top-2)
	for _, fd := range fds {
		dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 3)
		if err != nil {
			closeAll(files)
			return nil, fmt.Errorf("inherit_fd names descriptor %d, which the runtime did not pass: %w", fd, err)
		}
		files[fd-3] = os.NewFile(uintptr(dup), "inherited "+strconv.Itoa(fd))
	}
	return files, nil
}

func closeAll(files []*os.File) {
	for _, f := range files {
		if f != nil {
			f.Close()
		}
	}
}

// pidActions are the actions whose notification carries the root task's
// PID (send_criu_rpc_script).
var pidActions = map[string]bool{"setup-namespaces": true, "post-restore": true}

// notify hands one action to the runtime and waits for its answer. A
// post-dump is first committed, where the settings name a committer: the
// checkpoint is durable before the runtime hears of it and CRIU kills the
// tree, which it resumes instead if the commit fails.
func (c *call) notify(ctx context.Context, action string, pid int) error {
	if action == "post-dump" && c.commit != "" {
		if err := criusock.AskCommit(ctx, c.commit); err != nil {
			return err
		}
	}
	if !c.opts.GetNotifyScripts() {
		return nil // the runtime asked for no notifications
	}
	n := &rpc.CriuNotify{Script: proto.String(action)}
	if pidActions[action] {
		n.Pid = proto.Int32(int32(pid))
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	stop := context.AfterFunc(ctx, func() { c.conn.Close() })
	defer stop()
	if err := c.send(&rpc.CriuResp{Type: rpc.CriuReqType_NOTIFY.Enum(), Success: proto.Bool(true), Notify: n}); err != nil {
		return fmt.Errorf("notify the runtime of %s: %w", action, err)
	}
	ans, err := c.receive()
	if err != nil {
		return fmt.Errorf("the runtime's answer to %s: %w", action, err)
	}
	if ans.GetType() != rpc.CriuReqType_NOTIFY || !ans.GetNotifySuccess() {
		return fmt.Errorf("the runtime failed %s", action)
	}
	return nil
}

func (c *call) send(resp *rpc.CriuResp) error {
	b, err := proto.Marshal(resp)
	if err != nil {
		return err
	}
	_, err = c.conn.Write(b)
	return err
}

// receive reads one message; a descriptor sent with it (none is
// expected) is closed.
func (c *call) receive() (*rpc.CriuReq, error) {
	if c.buf == nil {
		c.buf = make([]byte, maxMessage)
	}
	buf := c.buf
	oob := make([]byte, unix.CmsgSpace(4*8))
	n, oobn, flags, _, err := c.conn.ReadMsgUnix(buf, oob)
	if msgs, perr := unix.ParseSocketControlMessage(oob[:oobn]); perr == nil {
		for _, m := range msgs {
			if fds, err := unix.ParseUnixRights(&m); err == nil {
				for _, fd := range fds {
					unix.Close(fd)
				}
			}
		}
	}
	switch {
	case err != nil:
		return nil, err
	case n == 0:
		return nil, errors.New("the runtime closed the connection")
	case flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0:
		return nil, fmt.Errorf("a message over %d bytes", maxMessage)
	}
	req := &rpc.CriuReq{}
	if err := proto.Unmarshal(buf[:n], req); err != nil {
		return nil, err
	}
	return req, nil
}

// logPath is CRIU's log file, where the runtime tells its user to look
// ("": CRIU logs to stderr).
func (c *call) logPath() string {
	name, err := logName(c.opts)
	if err != nil || name == "" {
		return ""
	}
	dir := c.images
	if c.work != nil {
		dir = c.work
	}
	return fdPath(os.Getpid(), dir) + "/" + name
}

// fail answers the request as failed and returns why. The reason goes
// into CRIU's log too (runc prints only the log's path), and the answer
// carries CRIU's first error line as cr_errmsg.
func (c *call) fail(why error) error {
	msg := "gpucr-stream swrk: " + why.Error()
	first := msg
	if logPath := c.logPath(); logPath != "" {
		if e := firstError(logPath); e != "" {
			first = e
		}
		if f, err := os.OpenFile(logPath, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600); err == nil {
			fmt.Fprintf(f, "Error (gpucr-stream swrk): %s\n", why)
			f.Close()
		}
	}
	resp := &rpc.CriuResp{Type: c.req.Type, Success: proto.Bool(false), CrErrmsg: proto.String(first)}
	if c.mode == "restore" {
		resp.Restore = &rpc.CriuRestoreResp{Pid: proto.Int32(-1)}
	}
	if err := c.send(resp); err != nil {
		return fmt.Errorf("%s; answering the runtime failed too: %v", msg, err)
	}
	return errors.New(msg)
}

// firstError is the first error line of a CRIU log (what CRIU's RPC
// sends as cr_errmsg).
func firstError(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if l := sc.Text(); strings.Contains(l, "Error") {
			return strings.TrimSpace(l)
		}
	}
	return ""
}
