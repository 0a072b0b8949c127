package criusock

import (
	"net"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// readerGone says whether the read end of pipe p is closed: poll reports
// POLLERR on a pipe's write end once it has no reader.
func readerGone(p *os.File) bool {
	return polled(p, 0, unix.POLLERR, false)
}

// peerGone says whether the other end of conn has closed it.
func peerGone(conn *net.UnixConn) bool {
	return polled(conn, unix.POLLRDHUP, unix.POLLRDHUP|unix.POLLHUP, true)
}

// polled polls c's descriptor once without waiting: whether any of want
// is set (ifClosed when the descriptor is already closed).
func polled(c syscall.Conn, events, want int16, ifClosed bool) bool {
	got := ifClosed
	rc, err := c.SyscallConn()
	if err != nil {
		return got
	}
	_ = rc.Control(func(fd uintptr) {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: events}}
		n, err := unix.Poll(pfd, 0)
		for err == unix.EINTR {
			n, err = unix.Poll(pfd, 0)
		}
		got = err == nil && n > 0 && pfd[0].Revents&want != 0
	})
	return got
}

// unread is what sits in pipe p's buffer, written but never read.
func unread(p *os.File) int64 {
	var n int
	if rc, err := p.SyscallConn(); err == nil {
		_ = rc.Control(func(fd uintptr) { n, _ = unix.IoctlGetInt(int(fd), unix.TIOCINQ) })
	}
	return int64(n)
}
