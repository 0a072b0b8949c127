// Package fdgraft puts a descriptor of ours into another process, in place
// of the read end of a pipe that process has just made.
//
// CRIU's restore in stream mode opens every image the same way
// (criu/img-streamer.c, establish_streamer_file_pipe): it asks the
// streamer for the file, reads the reply, makes a pipe, sends the
// streamer its write end and reads the image from the read end it keeps.
// The streamer never chooses what CRIU reads from, and some readers in
// CRIU need a file: do_restore_nftables sizes nftables-N.img with fstat
// (0 for a pipe: an empty ruleset), the restorer preadv()s a pages image
// at offsets (ESPIPE on a pipe). So, for those files, the streamer stops
// the CRIU task that asked (ptrace), answers, lets the task run to the
// pipe(2) of that request, and replaces the pipe's read end with a file of
// its own: the task receives it over the streamer socket it already holds
// (an injected recvmsg) and dup3()s it onto the read end's number. CRIU
// then reads a regular file descriptor and never knows; the write end it
// sends next has no reader and is closed.
//
// Only the asking task is traced, only between its request and its
// pipe(2) and for the five injected system calls, and it is detached
// before anything else runs; a task that is already traced, or that is
// this process's own child (its waiter would see the ptrace stops), is
// refused with ErrUnsupported before anything is answered.
package fdgraft

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// ErrUnsupported means no file can be handed to the peer here: another
// architecture, no right to trace it (not root, no CAP_SYS_PTRACE), or a
// task this process must not trace. Nothing was answered yet.
var ErrUnsupported = errors.New("cannot hand a file to the peer")

// findFor bounds the search for the asking task: it asked, so it is at
// most a scheduling delay away from blocking in its read of the reply.
// handFor bounds the rest, from the answer to the detach: microseconds of
// the task's time. Past it (or once the context ends) the task is woken
// with wakeSignal, which is held back, and let go.
var (
	findFor = 10 * time.Second
	handFor = 30 * time.Second
)

// wakeSignal wakes the tracer out of its wait for the task: a signal that
// stops a traced task wherever it is and whose default action is none.
const wakeSignal = unix.SIGURG

// Task is a stopped task that asked for a file on a connection: Hand
// answers it and gives it the file, Release lets it go untouched. Either
// must be called once.
type Task struct {
	TID    int
	sockfd int // its descriptor of the connection
	conn   *net.UnixConn
	// work runs on the tracing thread (ptrace requests must come from the
	// thread that attached); its goroutine ends when work is closed.
	work chan func()
	done chan struct{}
}

// Stop finds the task of the process at the other end of conn that waits
// for a reply on it, and stops it. The peer is the process that connected
// (its tree is searched: CRIU asks from forked helpers and from the tasks
// it restores). Errors wrap ErrUnsupported where tracing is not possible.
func Stop(ctx context.Context, conn *net.UnixConn) (*Task, error) {
	if !supported {
		return nil, fmt.Errorf("%s: %w", runtime.GOARCH, ErrUnsupported)
	}
	ino, err := peerInode(conn)
	if err != nil {
		return nil, fmt.Errorf("find the peer's socket: %w", err)
	}
	root, err := peerPID(conn)
	if err != nil {
		return nil, err
	}
	if root == os.Getpid() {
		return nil, fmt.Errorf("the peer is this process: %w", ErrUnsupported)
	}
	tid, fd, err := findWaiting(ctx, root, ino)
	if err != nil {
		return nil, err
	}
	if ppid := parentOf(tid); ppid == os.Getpid() {
		return nil, fmt.Errorf("task %d is a child of this process: %w", tid, ErrUnsupported)
	}
	t := &Task{TID: tid, sockfd: fd, conn: conn, work: make(chan func()), done: make(chan struct{})}
	stopped := make(chan error, 1)
	go t.tracer(stopped)
	if err := <-stopped; err != nil {
		<-t.done
		return nil, err
	}
	return t, nil
}

// tracer owns the OS thread that traces t. It never unlocks it: should it
// end with the task still attached, the thread exits with it and the
// kernel detaches the task.
func (t *Task) tracer(stopped chan<- error) {
	defer close(t.done)
	runtime.LockOSThread()
	if err := seize(t.TID); err != nil {
		stopped <- err
		return
	}
	stopped <- nil
	for fn := range t.work {
		fn()
	}
}

// on runs fn on the tracing thread and waits for it.
func (t *Task) on(fn func()) {
	ran := make(chan struct{})
	t.work <- func() { fn(); close(ran) }
	<-ran
}

// end stops the tracing goroutine and waits for it.
func (t *Task) end() {
	close(t.work)
	<-t.done
}

// Release detaches the task without answering it.
func (t *Task) Release() {
	t.on(func() { detach(t.TID, nil) })
	t.end()
}

// Hand answers the task (reply writes the answer on the connection), lets
// it run to the pipe(2) it makes for the answer, and replaces that pipe's
// read end with a copy of f. It returns the pipe's inode: the write end
// the task sends next is that pipe, with no reader left.
func (t *Task) Hand(ctx context.Context, f *os.File, reply func() error) (pipeIno uint64, err error) {
	defer t.end()
	t.on(func() { pipeIno, err = t.hand(ctx, f, reply) })
	return pipeIno, err
}

func (t *Task) hand(ctx context.Context, f *os.File, reply func() error) (uint64, error) {
	deadline := time.Now().Add(handFor)
	tr := &tracee{tid: t.TID, late: func() error {
		if err := ctx.Err(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not done within %s", handFor)
		}
		return nil
	}}
	tgid := tgidOf(t.TID)
	wake := func() { unix.Tgkill(tgid, t.TID, wakeSignal) }
	timer := time.AfterFunc(handFor, wake)
	defer timer.Stop()
	defer context.AfterFunc(ctx, wake)()
	if err := reply(); err != nil {
		detach(t.TID, nil)
		return 0, err
	}
	rd, err := tr.runToPipe(ctx)
	if err != nil {
		tr.detach()
		return 0, fmt.Errorf("task %d: %w", t.TID, err)
	}
	ino, err := pipeInode(t.TID, rd)
	if err == nil {
		err = t.send(f)
	}
	if err == nil {
		err = tr.replace(t.sockfd, rd)
	}
	if derr := tr.detach(); err == nil && derr != nil {
		err = derr
	}
	if err != nil {
		return 0, fmt.Errorf("hand a file to task %d: %w", t.TID, err)
	}
	return ino, nil
}

// send puts f on the connection, for the task's injected recvmsg.
func (t *Task) send(f *os.File) error {
	_, _, err := t.conn.WriteMsgUnix([]byte{0}, unix.UnixRights(int(f.Fd())), nil)
	runtime.KeepAlive(f)
	if err != nil {
		return fmt.Errorf("send the file: %w", err)
	}
	return nil
}

// seize attaches to tid and stops it.
func seize(tid int) error {
	_, _, e := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_SEIZE, uintptr(tid), 0, unix.PTRACE_O_TRACESYSGOOD, 0, 0)
	if e != 0 {
		if e == unix.EPERM || e == unix.EACCES {
			return fmt.Errorf("trace task %d: %w: %w", tid, e, ErrUnsupported)
		}
		return fmt.Errorf("trace task %d: %w", tid, e)
	}
	if err := unix.PtraceInterrupt(tid); err != nil {
		detach(tid, nil)
		return fmt.Errorf("stop task %d: %w", tid, err)
	}
	for {
		st, err := wait(tid)
		if err != nil {
			return err
		}
		if st.exited {
			return fmt.Errorf("task %d ended", tid)
		}
		if st.event == unix.PTRACE_EVENT_STOP {
			return nil
		}
		// A signal arrived first: deliver it on, then take the stop.
		if err := unix.PtraceCont(tid, st.deliver()); err != nil {
			return fmt.Errorf("stop task %d: %w", tid, err)
		}
	}
}

// detach lets tid go, delivering the signals held back while it was traced.
func detach(tid int, held []unix.Signal) error {
	first := 0
	if len(held) > 0 {
		first = int(held[0])
	}
	if _, _, e := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_DETACH, uintptr(tid), 0, uintptr(first), 0, 0); e != 0 {
		return fmt.Errorf("detach task %d: %w", tid, e)
	}
	for _, s := range held[min(1, len(held)):] {
		unix.Tgkill(tgidOf(tid), tid, s)
	}
	return nil
}

// stop is one wait status of a traced task.
type stop struct {
	exited  bool
	sig     unix.Signal // the stop signal
	event   int         // PTRACE_EVENT_*, 0 for none
	syscall bool        // a syscall-entry or -exit stop
}

// deliver is the signal to pass on when resuming from this stop: that of a
// signal-delivery stop, none otherwise.
func (s stop) deliver() int {
	if s.syscall || s.event != 0 {
		return 0
	}
	return int(s.sig)
}

func wait(tid int) (stop, error) {
	var ws unix.WaitStatus
	for {
		_, err := unix.Wait4(tid, &ws, unix.WALL, nil)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return stop{}, fmt.Errorf("wait for task %d: %w", tid, err)
		}
		break
	}
	if ws.Exited() || ws.Signaled() {
		return stop{exited: true}, nil
	}
	raw := uint32(ws)
	sig := unix.Signal((raw >> 8) & 0xff)
	return stop{sig: sig, event: int(raw >> 16), syscall: sig == unix.SIGTRAP|0x80}, nil
}
