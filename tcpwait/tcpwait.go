// Package tcpwait clears the TIME_WAIT sockets that would stop CRIU from
// binding a restored socket to its port.
//
// A program's listening socket without SO_REUSEADDR (NCCL's bootstrap
// listeners are such) leaves TIME_WAIT sockets on its own port whenever
// an accepted connection closes first. While the listener lives they do
// not matter; once CRIU has dumped and killed the program they do: the
// restore in place binds the port again, and a TIME_WAIT socket whose
// owner did not allow reuse refuses that bind ("Can't bind inet socket:
// Address already in use") for up to a minute. Before CRIU restores,
// Clear asks the kernel (sock_diag, SOCK_DESTROY: CAP_NET_ADMIN and
// CONFIG_INET_DIAG_DESTROY) to drop the TIME_WAIT sockets, and only those,
// whose local port is one the checkpoint binds. A TIME_WAIT socket only
// guards against stray segments of a connection that is already closed.
package tcpwait

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// ErrNotCleared says a TIME_WAIT socket could not be dropped (no
// CAP_NET_ADMIN, or a kernel without SOCK_DESTROY).
var ErrNotCleared = errors.New("TIME_WAIT socket not cleared")

const (
	sockDiagByFamily = 20
	sockDestroy      = 21
	tcpTimeWait      = 6
	reqLen           = 56 // struct inet_diag_req_v2
	msgLen           = 72 // struct inet_diag_msg
	sockIDLen        = 48 // struct inet_diag_sockid
)

// Cleared is what Clear dropped.
type Cleared struct {
	Sockets int
	Ports   []uint16
}

// Clear drops the TIME_WAIT TCP sockets of this network namespace whose
// local port is in ports, IPv4 and IPv6.
func Clear(ctx context.Context, ports map[uint16]bool) (Cleared, error) {
	var c Cleared
	if len(ports) == 0 {
		return c, nil
	}
	seen := map[uint16]bool{}
	for _, fam := range []uint8{unix.AF_INET, unix.AF_INET6} {
		if err := ctx.Err(); err != nil {
			return c, err
		}
		ids, err := timeWait(fam, ports)
		if err != nil {
			return c, fmt.Errorf("list TIME_WAIT sockets: %w", err)
		}
		for _, id := range ids {
			if err := destroy(fam, id); err != nil {
				return c, fmt.Errorf("clear TIME_WAIT socket on port %d: %w: %w", port(id), ErrNotCleared, err)
			}
			c.Sockets++
			if p := port(id); !seen[p] {
				seen[p] = true
				c.Ports = append(c.Ports, p)
			}
		}
	}
	return c, nil
}

// port is the local port of an inet_diag_sockid (network order).
func port(id []byte) uint16 { return binary.BigEndian.Uint16(id[0:2]) }

func request(typ uint16, flags uint16, fam uint8, id []byte) []byte {
	b := make([]byte, unix.NLMSG_HDRLEN+reqLen)
	binary.NativeEndian.PutUint32(b[0:], uint32(len(b)))
	binary.NativeEndian.PutUint16(b[4:], typ)
	binary.NativeEndian.PutUint16(b[6:], flags)
	binary.NativeEndian.PutUint32(b[8:], 1) // seq
	r := b[unix.NLMSG_HDRLEN:]
	r[0], r[1] = fam, unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(r[4:], 1<<tcpTimeWait)
	copy(r[8:8+sockIDLen], id)
	return b
}

func dial() (int, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return -1, os.NewSyscallError("socket(NETLINK_SOCK_DIAG)", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return -1, os.NewSyscallError("bind", err)
	}
	return fd, nil
}

// timeWait lists the inet_diag_sockids of family fam's TIME_WAIT sockets
// on ports.
func timeWait(fam uint8, ports map[uint16]bool) ([][]byte, error) {
	fd, err := dial()
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	if err := unix.Sendto(fd, request(sockDiagByFamily, unix.NLM_F_REQUEST|unix.NLM_F_DUMP, fam, nil), 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, os.NewSyscallError("sendto", err)
	}
	var ids [][]byte
	buf := make([]byte, 1<<16)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return nil, os.NewSyscallError("recvfrom", err)
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return nil, err
		}
		for _, m := range msgs {
			switch m.Header.Type {
			case unix.NLMSG_DONE:
				return ids, nil
			case unix.NLMSG_ERROR:
				return nil, nlError(m.Data)
			}
			if len(m.Data) < msgLen || m.Data[1] != tcpTimeWait {
				continue
			}
			id := append([]byte(nil), m.Data[4:4+sockIDLen]...)
			if ports[port(id)] {
				ids = append(ids, id)
			}
		}
	}
}

// destroy drops the socket id names (its cookie included).
func destroy(fam uint8, id []byte) error {
	fd, err := dial()
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Sendto(fd, request(sockDestroy, unix.NLM_F_REQUEST|unix.NLM_F_ACK, fam, id), 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return os.NewSyscallError("sendto", err)
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, buf, 0)
	if err != nil {
		return os.NewSyscallError("recvfrom", err)
	}
	msgs, err := syscall.ParseNetlinkMessage(buf[:n])
	if err != nil {
		return err
	}
	for _, m := range msgs {
		if m.Header.Type == unix.NLMSG_ERROR {
			if err := nlError(m.Data); err != nil && !errors.Is(err, unix.ENOENT) {
				// ENOENT: it expired meanwhile.
				return err
			}
			return nil
		}
	}
	return fmt.Errorf("no answer to SOCK_DESTROY")
}

func nlError(data []byte) error {
	if len(data) < 4 {
		return fmt.Errorf("short netlink error message")
	}
	if e := int32(binary.NativeEndian.Uint32(data)); e != 0 {
		return os.NewSyscallError("sock_diag", unix.Errno(-e))
	}
	return nil
}
