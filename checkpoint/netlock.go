package checkpoint

// CRIU's network lock. With --tcp-established CRIU keeps the peers of the
// connections it dumps from talking to them while the tree is frozen, with
// netfilter rules: by default it runs iptables, which many hosts (the GPU
// machine among them) do not have. The dump then fails at its first
// connection ("Failed to lock TCP connection", an exit status 127) after
// the tree was frozen, and after the GPU step, which the driver may not be
// able to undo. So the method is chosen before anything is touched:
// nftables where CRIU can use it (built with libnftables, as Debian's is:
// `criu check --feature network_lock_nftables`), else iptables where it is
// installed, else the dump is refused naming the package to install. A
// restore of such a dump must use the same method, and takes it by the
// same rule.

import (
	"context"
	"fmt"
	"os/exec"
	"slices"
	"strings"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/proc"
)

// netLocks says which network lock methods this host offers criu.
var netLocks = func(ctx context.Context, criu string) (nftables, iptables bool) {
	nftables = exec.CommandContext(ctx, criu, "check", "--feature", "network_lock_nftables").Run() == nil
	_, err := exec.LookPath("iptables")
	return nftables, err == nil
}

// lockArgs are the criu arguments with the network lock method this host
// offers added where --tcp-established needs one and none is named; nil
// where they need nothing added.
func lockArgs(ctx context.Context, criu string, args []string) (add []string, ok bool) {
	if !slices.Contains(args, "--tcp-established") || slices.ContainsFunc(args, func(a string) bool {
		return a == "--network-lock" || strings.HasPrefix(a, "--network-lock=")
	}) {
		return nil, true
	}
	nft, ipt := netLocks(ctx, criu)
	switch {
	case nft:
		return []string{"--network-lock", "nftables"}, true
	case ipt:
		return []string{"--network-lock", "iptables"}, true
	}
	return nil, false
}

// dumpNetworkLock returns the criu arguments of a dump of tree with the
// network lock chosen, or, before anything is frozen, an error naming what
// is missing when the tree holds connections to lock and the host offers
// no method.
func dumpNetworkLock(ctx context.Context, criu string, args []string, tree []int) ([]string, error) {
	add, ok := lockArgs(ctx, criu, args)
	if ok {
		return append(slices.Clip(args), add...), nil
	}
	conns := proc.EstablishedTCP(tree)
	if len(conns) == 0 {
		return args, nil // nothing to lock
	}
	msg := fmt.Sprintf("criu dumps the tree's %d established TCP connections (--tcp-established) only with a network lock, and this host offers none: "+
		"criu cannot use nftables here (`%s check --feature network_lock_nftables` fails: a criu built without libnftables, or a kernel without nf_tables) "+
		"and iptables is not installed (Debian: apt-get install iptables); refused before the tree was frozen", len(conns), criu)
	if internal(conns) {
		msg += "; every connection is between processes of the tree, frozen together, so --criu-opts '--tcp-established --network-lock skip' is safe"
	}
	return nil, errdefs.Usagef("%s", msg)
}

// restoreNetworkLock returns the criu arguments of a restore with the
// network lock method a dump on this host would have chosen.
func restoreNetworkLock(ctx context.Context, criu string, args []string) []string {
	add, _ := lockArgs(ctx, criu, args)
	return append(slices.Clip(args), add...)
}

// internal says whether every connection has its other end in the same
// set (a loopback connection between processes of the tree).
func internal(conns []proc.TCPConn) bool {
	local := map[string]bool{}
	for _, c := range conns {
		local[c.Local] = true
	}
	for _, c := range conns {
		if !local[c.Remote] {
			return false
		}
	}
	return true
}
