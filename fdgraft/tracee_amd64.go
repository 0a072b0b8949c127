package fdgraft

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

const supported = true

// maxSteps bounds the system calls the task may make between the reply
// and its pipe(2): CRIU makes two reads (length, message) and at most an
// allocation or two.
const maxSteps = 64

// readsSocket says whether system call nr reads a socket as CRIU does.
func readsSocket(nr int) bool {
	return nr == unix.SYS_READ || nr == unix.SYS_RECVFROM || nr == unix.SYS_RECVMSG
}

// tracee is a seized task and what must be given back when it is let go.
type tracee struct {
	tid int
	// late says why to give up, once the wake signal came: the context
	// ended or the time is up (nil: a signal of the task's own).
	late  func() error
	regs  unix.PtraceRegsAmd64 // at the exit of its pipe(2)
	saved bool
	held  []unix.Signal // signals that arrived during the injection
}

// syscallInfo is struct ptrace_syscall_info (linux/ptrace.h): op, then for
// an entry the number and arguments, for an exit the return value.
type syscallInfo struct {
	Op   uint8
	_    [3]uint8
	Arch uint32
	IP   uint64
	SP   uint64
	Nr   uint64 // entry: nr; exit: rval
	Args [6]uint64
	_    uint64 // seccomp's ret_data
}

func getSyscallInfo(tid int) (syscallInfo, error) {
	var si syscallInfo
	_, _, e := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_GET_SYSCALL_INFO, uintptr(tid), unsafe.Sizeof(si), uintptr(unsafe.Pointer(&si)), 0, 0)
	if e != 0 {
		return si, fmt.Errorf("syscall info: %w", e)
	}
	return si, nil
}

// runToPipe resumes the task system call by system call until its pipe(2)
// returns, and says the read end it made.
func (t *tracee) runToPipe(ctx context.Context) (int, error) {
	sig := 0
	var args [6]uint64
	var nr uint64
	for steps := 0; steps < 2*maxSteps; steps++ {
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		if err := unix.PtraceSyscall(t.tid, sig); err != nil {
			return 0, fmt.Errorf("resume: %w", err)
		}
		st, err := wait(t.tid)
		if err != nil {
			return 0, err
		}
		if st.exited {
			return 0, errors.New("it ended")
		}
		sig = st.deliver()
		if sig == int(wakeSignal) {
			if err := t.late(); err != nil {
				return 0, fmt.Errorf("waiting for its pipe(2): %w", err)
			}
		}
		if !st.syscall {
			continue
		}
		si, err := getSyscallInfo(t.tid)
		if err != nil {
			return 0, err
		}
		switch si.Op {
		case unix.PTRACE_SYSCALL_INFO_ENTRY:
			nr, args = si.Nr, si.Args
		case unix.PTRACE_SYSCALL_INFO_EXIT:
			if nr != unix.SYS_PIPE && nr != unix.SYS_PIPE2 {
				continue
			}
			if int64(si.Nr) != 0 {
				return 0, fmt.Errorf("its pipe(2) failed: %w", unix.Errno(-int64(si.Nr)))
			}
			var fds [8]byte
			if _, err := unix.PtracePeekData(t.tid, uintptr(args[0]), fds[:]); err != nil {
				return 0, fmt.Errorf("read its pipe's descriptors: %w", err)
			}
			if err := unix.PtraceGetRegsAmd64(t.tid, &t.regs); err != nil {
				return 0, fmt.Errorf("registers: %w", err)
			}
			t.saved = true
			return int(int32(binary.NativeEndian.Uint32(fds[:]))), nil
		}
	}
	return 0, fmt.Errorf("no pipe(2) within %d system calls of the reply", maxSteps)
}

// replace makes the task receive the descriptor waiting on its socket
// sockfd and put it in place of fd: mmap a scratch page, recvmsg into it,
// dup3 onto fd, close the received one, munmap. Called at the exit stop of
// its pipe(2), whose `syscall` instruction every injection reuses.
func (t *tracee) replace(sockfd, fd int) error {
	var insn [2]byte
	if _, err := unix.PtracePeekText(t.tid, uintptr(t.regs.Rip-2), insn[:]); err != nil || insn != [2]byte{0x0f, 0x05} {
		return fmt.Errorf("no syscall instruction before %#x (%x, %v)", t.regs.Rip, insn, err)
	}
	page, err := t.inject(unix.SYS_MMAP, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS, ^uint64(0), 0)
	if err != nil {
		return fmt.Errorf("mmap: %w", err)
	}
	got, rerr := t.receive(sockfd, page)
	if rerr == nil {
		if _, err := t.inject(unix.SYS_DUP3, uint64(got), uint64(fd), 0); err != nil {
			rerr = fmt.Errorf("dup3: %w", err)
		}
		if _, err := t.inject(unix.SYS_CLOSE, uint64(got)); err != nil && rerr == nil {
			rerr = fmt.Errorf("close: %w", err)
		}
	}
	if _, err := t.inject(unix.SYS_MUNMAP, page, 4096); err != nil && rerr == nil {
		rerr = fmt.Errorf("munmap: %w", err)
	}
	return rerr
}

// Layout of the scratch page for recvmsg: the msghdr, one iovec, the
// byte that carries the descriptor, the control message.
const (
	offIov     = 64
	offByte    = 80
	offControl = 96
)

// receive injects recvmsg(sockfd) into the scratch page and returns the
// descriptor it brought.
func (t *tracee) receive(sockfd int, page uint64) (int, error) {
	ctl := unix.CmsgSpace(4)
	b := make([]byte, offControl+ctl)
	ne := binary.NativeEndian
	// struct msghdr: name, namelen, iov, iovlen, control, controllen, flags.
	ne.PutUint64(b[16:], page+offIov)
	ne.PutUint64(b[24:], 1)
	ne.PutUint64(b[32:], page+offControl)
	ne.PutUint64(b[40:], uint64(ctl))
	ne.PutUint64(b[offIov:], page+offByte)
	ne.PutUint64(b[offIov+8:], 1)
	if _, err := unix.PtracePokeData(t.tid, uintptr(page), b); err != nil {
		return 0, fmt.Errorf("write its scratch page: %w", err)
	}
	n, err := t.inject(unix.SYS_RECVMSG, uint64(sockfd), page, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return 0, fmt.Errorf("recvmsg: %w", err)
	}
	if _, err := unix.PtracePeekData(t.tid, uintptr(page), b); err != nil {
		return 0, fmt.Errorf("read its scratch page: %w", err)
	}
	if n != 1 || int32(ne.Uint32(b[48:]))&unix.MSG_CTRUNC != 0 {
		return 0, fmt.Errorf("recvmsg took %d bytes, flags %#x", n, ne.Uint32(b[48:]))
	}
	msgs, err := unix.ParseSocketControlMessage(b[offControl : offControl+int(ne.Uint64(b[40:]))])
	if err != nil || len(msgs) != 1 {
		return 0, fmt.Errorf("recvmsg brought no descriptor (%v)", err)
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		return 0, fmt.Errorf("recvmsg brought no descriptor (%v)", err)
	}
	return fds[0], nil
}

// inject runs system call nr with args in the task, from the `syscall`
// instruction of its pipe(2), and returns its result. Signals that arrive
// meanwhile are held back (a handler must not run on these registers) and
// delivered at detach.
func (t *tracee) inject(nr uint64, args ...uint64) (uint64, error) {
	r := t.regs
	r.Rax, r.Orig_rax, r.Rip = nr, ^uint64(0), t.regs.Rip-2
	a := [6]*uint64{&r.Rdi, &r.Rsi, &r.Rdx, &r.R10, &r.R8, &r.R9}
	for i, v := range args {
		*a[i] = v
	}
	if err := unix.PtraceSetRegsAmd64(t.tid, &r); err != nil {
		return 0, fmt.Errorf("set registers: %w", err)
	}
	for stops := 0; stops < 2; {
		if err := unix.PtraceSyscall(t.tid, 0); err != nil {
			return 0, fmt.Errorf("resume: %w", err)
		}
		st, err := wait(t.tid)
		if err != nil {
			return 0, err
		}
		switch {
		case st.exited:
			return 0, errors.New("it ended")
		case st.syscall:
			stops++
		case st.sig == wakeSignal && t.late() != nil:
			return 0, t.late()
		case st.deliver() != 0:
			t.held = append(t.held, st.sig)
		}
	}
	if err := unix.PtraceGetRegsAmd64(t.tid, &r); err != nil {
		return 0, fmt.Errorf("registers: %w", err)
	}
	if ret := int64(r.Rax); ret < 0 && ret >= -4095 {
		return 0, unix.Errno(-ret)
	}
	return r.Rax, nil
}

// detach puts the registers of the pipe(2)'s exit back and lets the task
// go on.
func (t *tracee) detach() error {
	var err error
	if t.saved {
		if err = unix.PtraceSetRegsAmd64(t.tid, &t.regs); err != nil {
			err = fmt.Errorf("restore registers: %w", err)
		}
	}
	if derr := detach(t.tid, t.held); err == nil {
		err = derr
	}
	return err
}
