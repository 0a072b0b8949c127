package checkpoint

import (
	"context"
	"errors"
	"net"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/proc"
)

// TestDumpNetworkLock: the lock method is the host's (nftables first),
// named only where --tcp-established needs one and none is given; without
// any, a tree with connections is refused naming the package, and skip is
// offered only where every connection stays inside the tree.
func TestDumpNetworkLock(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
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
	self := []int{os.Getpid()}
	old := netLocks
	t.Cleanup(func() { netLocks = old })
	for _, tc := range []struct {
		name     string
		nft, ipt bool
		args     []string
		tree     []int
		want     string // the args after, joined; "refused" for an error
		asked    bool
	}{
		{"no tcp-established", true, true, []string{"--shell-job"}, self, "--shell-job", false},
		{"method given", true, true, []string{"--tcp-established", "--network-lock", "iptables"}, self, "--tcp-established --network-lock iptables", false},
		{"nftables first", true, true, []string{"--tcp-established"}, self, "--tcp-established --network-lock nftables", true},
		{"iptables", false, true, []string{"--tcp-established"}, self, "--tcp-established --network-lock iptables", true},
		{"none, nothing to lock", false, false, []string{"--tcp-established"}, []int{1 << 30}, "--tcp-established", true},
		{"none, connections", false, false, []string{"--tcp-established"}, self, "refused", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			asked := false
			netLocks = func(context.Context, string) (bool, bool) { asked = true; return tc.nft, tc.ipt }
			args := slices.Clone(tc.args)
			got, err := dumpNetworkLock(context.Background(), "criu", args, tc.tree)
			if asked != tc.asked {
				t.Errorf("host asked: %v, want %v", asked, tc.asked)
			}
			if !slices.Equal(args, tc.args) {
				t.Errorf("the caller's args changed: %q", args)
			}
			if tc.want == "refused" {
				if !errors.Is(err, errdefs.ErrUsage) || !strings.Contains(err.Error(), "apt-get install iptables") ||
					!strings.Contains(err.Error(), "network_lock_nftables") || !strings.Contains(err.Error(), "--network-lock skip") {
					t.Fatalf("err = %v", err)
				}
				return
			}
			if err != nil || strings.Join(got, " ") != tc.want {
				t.Fatalf("got %q, %v; want %q", got, err, tc.want)
			}
			// A restore takes the method a dump here would have.
			if r := restoreNetworkLock(context.Background(), "criu", args); strings.Join(r, " ") != tc.want {
				t.Errorf("restore args %q, want %q", r, tc.want)
			}
		})
	}
}

// TestInternal: skip is safe only where both ends of every connection are
// in the tree.
func TestInternal(t *testing.T) {
	a, b := "127.0.0.1:40000", "127.0.0.1:40001"
	in := []proc.TCPConn{{PID: 1, Local: a, Remote: b}, {PID: 2, Local: b, Remote: a}}
	out := []proc.TCPConn{{PID: 1, Local: a, Remote: "10.0.0.9:443"}}
	if !internal(in) || internal(out) || internal(append(in, out...)) {
		t.Fatal("internal")
	}
}
