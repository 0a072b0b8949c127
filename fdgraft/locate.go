package fdgraft

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/proc"
)

// sock_diag for AF_UNIX (linux/unix_diag.h).
const (
	udiagShowPeer = 0x4
	unixDiagPeer  = 2
	diagReqLen    = 24 // struct unix_diag_req
	diagMsgLen    = 16 // struct unix_diag_msg
)

// peerInode is the inode of the socket at the other end of conn, which is
// what /proc/PID/fd of every holder of it shows.
func peerInode(conn *net.UnixConn) (uint64, error) {
	var st unix.Stat_t
	if err := control(conn, func(fd int) error { return unix.Fstat(fd, &st) }); err != nil {
		return 0, err
	}
	s, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return 0, fmt.Errorf("sock_diag: %w", err)
	}
	defer unix.Close(s)
	req := make([]byte, unix.NLMSG_HDRLEN+diagReqLen)
	ne := binary.NativeEndian
	ne.PutUint32(req[0:], uint32(len(req)))
	ne.PutUint16(req[4:], unix.SOCK_DIAG_BY_FAMILY)
	ne.PutUint16(req[6:], unix.NLM_F_REQUEST)
	ne.PutUint32(req[8:], 1) // sequence
	b := req[unix.NLMSG_HDRLEN:]
	b[0] = unix.AF_UNIX
	ne.PutUint32(b[4:], ^uint32(0)) // every state
	ne.PutUint32(b[8:], uint32(st.Ino))
	ne.PutUint32(b[12:], udiagShowPeer)
	ne.PutUint32(b[16:], ^uint32(0)) // no cookie
	ne.PutUint32(b[20:], ^uint32(0))
	if err := unix.Sendto(s, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return 0, fmt.Errorf("sock_diag: %w", err)
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(s, buf, 0)
	if err != nil {
		return 0, fmt.Errorf("sock_diag: %w", err)
	}
	msgs, err := syscall.ParseNetlinkMessage(buf[:n])
	if err != nil {
		return 0, fmt.Errorf("sock_diag: %w", err)
	}
	for _, m := range msgs {
		switch {
		case m.Header.Type == unix.NLMSG_ERROR && len(m.Data) >= 4:
			if e := int32(ne.Uint32(m.Data)); e != 0 {
				return 0, fmt.Errorf("sock_diag of socket %d: %w", st.Ino, syscall.Errno(-e))
			}
		case m.Header.Type == unix.SOCK_DIAG_BY_FAMILY && len(m.Data) >= diagMsgLen:
			if peer, ok := diagAttr(m.Data[diagMsgLen:], unixDiagPeer); ok && len(peer) >= 4 {
				return uint64(ne.Uint32(peer)), nil
			}
		}
	}
	return 0, fmt.Errorf("sock_diag: no peer for socket %d", st.Ino)
}

// diagAttr finds attribute typ among netlink attributes b.
func diagAttr(b []byte, typ uint16) ([]byte, bool) {
	for len(b) >= unix.SizeofRtAttr {
		l := int(binary.NativeEndian.Uint16(b))
		t := binary.NativeEndian.Uint16(b[2:])
		if l < unix.SizeofRtAttr || l > len(b) {
			return nil, false
		}
		if t == typ {
			return b[unix.SizeofRtAttr:l], true
		}
		b = b[min(len(b), (l+3)&^3):]
	}
	return nil, false
}

// peerPID is the process that connected conn.
func peerPID(conn *net.UnixConn) (int, error) {
	var cred *unix.Ucred
	err := control(conn, func(fd int) (err error) {
		cred, err = unix.GetsockoptUcred(fd, unix.SOL_SOCKET, unix.SO_PEERCRED)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("the peer's process: %w", err)
	}
	if cred.Pid <= 0 {
		return 0, fmt.Errorf("the peer's process is outside this PID namespace: %w", ErrUnsupported)
	}
	return int(cred.Pid), nil
}

func control(conn *net.UnixConn, fn func(fd int) error) error {
	rc, err := conn.SyscallConn()
	if err != nil {
		return err
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = fn(int(fd)) }); err != nil {
		return err
	}
	return ferr
}

// findWaiting polls the tree under root for the task blocked reading the
// socket of inode ino: the one that asked. CRIU holds a lock from each
// request until its pipe is sent, so no other task of it reads there.
func findWaiting(ctx context.Context, root int, ino uint64) (tid, fd int, err error) {
	want := fmt.Sprintf("socket:[%d]", ino)
	deadline := time.Now().Add(findFor)
	for pause := 20 * time.Microsecond; ; pause = min(2*pause, time.Millisecond) {
		pids, err := proc.Tree(root)
		if err != nil {
			return 0, 0, fmt.Errorf("the peer's process %d: %w", root, err)
		}
		for _, pid := range pids {
			if tid, fd, ok := waitingIn(pid, want); ok {
				return tid, fd, nil
			}
		}
		if time.Now().After(deadline) {
			return 0, 0, fmt.Errorf("no task under process %d waits on %s after %s", root, want, findFor)
		}
		select {
		case <-ctx.Done():
			return 0, 0, ctx.Err()
		case <-time.After(pause):
		}
	}
}

// waitingIn finds a thread of pid blocked in a read of the socket named want.
func waitingIn(pid int, want string) (tid, fd int, ok bool) {
	dir := filepath.Join(proc.Root, strconv.Itoa(pid), "task")
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(dir, e.Name(), "syscall"))
		if err != nil {
			continue
		}
		f := strings.Fields(string(b))
		if len(f) < 2 {
			continue // "running"
		}
		nr, err1 := strconv.Atoi(f[0])
		arg, err2 := strconv.ParseUint(strings.TrimPrefix(f[1], "0x"), 16, 32)
		if err1 != nil || err2 != nil || !readsSocket(nr) {
			continue
		}
		link, err := os.Readlink(filepath.Join(proc.Root, strconv.Itoa(pid), "fd", strconv.FormatUint(arg, 10)))
		if err == nil && link == want {
			t, _ := strconv.Atoi(e.Name())
			return t, int(arg), true
		}
	}
	return 0, 0, false
}

// statusField reads one field of /proc/TID/status.
func statusField(tid int, name string) int {
	b, _ := os.ReadFile(filepath.Join(proc.Root, strconv.Itoa(tid), "status"))
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, name+":"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}

func parentOf(tid int) int { return statusField(tid, "PPid") }
func tgidOf(tid int) int   { return statusField(tid, "Tgid") }

// pipeInode is the inode of the pipe tid holds as fd.
func pipeInode(tid, fd int) (uint64, error) {
	link, err := os.Readlink(filepath.Join(proc.Root, strconv.Itoa(tid), "fd", strconv.Itoa(fd)))
	if err != nil {
		return 0, fmt.Errorf("its descriptor %d: %w", fd, err)
	}
	s, ok := strings.CutPrefix(link, "pipe:[")
	ino, err := strconv.ParseUint(strings.TrimSuffix(s, "]"), 10, 64)
	if !ok || err != nil {
		return 0, fmt.Errorf("its descriptor %d is %s, not a pipe", fd, link)
	}
	return ino, nil
}
