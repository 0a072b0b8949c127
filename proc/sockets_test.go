package proc

import (
	"net"
	"os"
	"strings"
	"testing"
)

func TestTCPAddr(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"0100007F:1F90", "127.0.0.1:8080"},
		{"00000000000000000000000001000000:0016", "[::1]:22"},
		{"zz:1", "zz:1"},
		{"0100007F", "0100007F"},
	} {
		if got := tcpAddr(tc.in); got != tc.want {
			t.Errorf("tcpAddr(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// TestEstablishedTCP holds a real loopback connection in this process and
// finds it, and finds nothing for a listening socket alone.
func TestEstablishedTCP(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	self := []int{os.Getpid()}
	if got := EstablishedTCP(self); len(got) != 0 {
		t.Fatalf("a listener alone: %v", got)
	}
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got := EstablishedTCP(self)
	if len(got) != 2 {
		t.Fatalf("want both ends of the connection, got %v", got)
	}
	var found bool
	for _, g := range got {
		if g.Local == c.LocalAddr().String() && g.Remote == ln.Addr().String() {
			found = true
		}
	}
	if !found || !strings.Contains(got[0].String(), "->") {
		t.Fatalf("the client's end %s -> %s not in %v", c.LocalAddr(), ln.Addr(), got)
	}
}
