package tcpwait

import (
	"context"
	"errors"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// listener makes a TCP listener on 127.0.0.1 without SO_REUSEADDR (as NCCL
// makes its own), accepts one connection and closes the accepted side
// first, which leaves a TIME_WAIT socket on the listener's port; then the
// listener closes too. It returns the port.
func listener(t *testing.T) uint16 {
	t.Helper()
	l, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(l)
	if err := unix.Bind(l, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(l, 1); err != nil {
		t.Fatal(err)
	}
	sa, _ := unix.Getsockname(l)
	p := sa.(*unix.SockaddrInet4).Port
	c, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(c)
	if err := unix.Connect(c, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}, Port: p}); err != nil {
		t.Fatal(err)
	}
	a, _, err := unix.Accept(l)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(a) // the accepted side closes first: its TIME_WAIT is on p
	var b [1]byte
	if n, err := unix.Read(c, b[:]); n != 0 || err != nil {
		t.Fatalf("read of the closed connection: %d, %v", n, err)
	}
	return uint16(p)
}

// bindAsCRIU binds a new socket to 127.0.0.1:p as CRIU does on restore
// (SO_REUSEADDR and SO_REUSEPORT set first).
func bindAsCRIU(t *testing.T, p uint16) error {
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(s)
	unix.SetsockoptInt(s, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	unix.SetsockoptInt(s, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
	return unix.Bind(s, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}, Port: int(p)})
}

func TestClear(t *testing.T) {
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("SOCK_DESTROY needs CAP_NET_ADMIN: run as root")
		}
		t.Skip("needs root (CAP_NET_ADMIN)")
	}
	ctx := context.Background()
	p, other := listener(t), listener(t)
	if err := bindAsCRIU(t, p); !errors.Is(err, unix.EADDRINUSE) {
		t.Fatalf("bind next to a TIME_WAIT socket that did not allow reuse: %v, want EADDRINUSE (the failure cleared here)", err)
	}
	c, err := Clear(ctx, map[uint16]bool{p: true})
	if err != nil {
		t.Fatal(err)
	}
	if c.Sockets != 1 || len(c.Ports) != 1 || c.Ports[0] != p {
		t.Fatalf("cleared %+v, want one socket on port %d", c, p)
	}
	if err := bindAsCRIU(t, p); err != nil {
		t.Fatalf("bind after the clear: %v", err)
	}
	// Only the ports asked for: the other listener's TIME_WAIT stays.
	if err := bindAsCRIU(t, other); !errors.Is(err, unix.EADDRINUSE) {
		t.Fatalf("bind to a port not cleared: %v, want EADDRINUSE", err)
	}
	if c, err := Clear(ctx, nil); err != nil || c.Sockets != 0 {
		t.Fatalf("clear of no ports: %+v, %v", c, err)
	}
}
