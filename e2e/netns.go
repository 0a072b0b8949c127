package e2e

// Two hosts made of network namespaces joined by a veth pair, for the live
// migration tests: traffic goes only between the two namespaces.
//
// Commands run inside a namespace by entering its network namespace on a
// locked OS thread and starting the process from there (InNetns): a child
// inherits its parent thread's network namespace and nothing else changes.
// `ip netns exec` would also give every command its own mount namespace,
// and CRIU then sees the target in a mount namespace other than its own.

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// NetPair is two network namespaces joined by a veth pair: A (VethA,
// AddrA) and B (VethB, AddrB), on a /24 of their own.
type NetPair struct {
	A, B         string
	VethA, VethB string
	AddrA, AddrB string
}

const netnsPrefix = "gcs-e2e-"

var netSeq atomic.Int32

// NeedTool fails (under CI=true) or skips the test when a command is not
// installed; it returns the command's path.
func NeedTool(t testing.TB, name string) string {
	t.Helper()
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	for _, dir := range []string{"/usr/sbin", "/sbin", "/usr/bin"} {
		if p := filepath.Join(dir, name); fileExists(p) {
			return p
		}
	}
	missing(t, "%s not found (run scripts/install-deps.sh)", name)
	return ""
}

// NewNetPair creates the namespaces and the link; they are deleted when the
// test ends, also when it fails.
func NewNetPair(t testing.TB) *NetPair {
	t.Helper()
	if os.Geteuid() != 0 {
		missing(t, "network namespaces need root (euid %d)", os.Geteuid())
	}
	ip := NeedTool(t, "ip")
	removeStaleNetns(ip)
	n := netSeq.Add(1)
	base := fmt.Sprintf("%s%d-%d-", netnsPrefix, os.Getpid(), n)
	p := &NetPair{
		A: base + "a", B: base + "b",
		VethA: fmt.Sprintf("gv%da", n), VethB: fmt.Sprintf("gv%db", n),
		AddrA: fmt.Sprintf("10.231.%d.1", n%250), AddrB: fmt.Sprintf("10.231.%d.2", n%250),
	}
	t.Cleanup(func() {
		for _, ns := range []string{p.A, p.B} {
			if out, err := exec.Command(ip, "netns", "del", ns).CombinedOutput(); err != nil && !strings.Contains(string(out), "No such file") {
				t.Errorf("ip netns del %s: %v: %s", ns, err, out)
			}
		}
	})
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(ip, args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	run("netns", "add", p.A)
	run("netns", "add", p.B)
	run("link", "add", p.VethA, "netns", p.A, "type", "veth", "peer", "name", p.VethB, "netns", p.B)
	run("-n", p.A, "addr", "add", p.AddrA+"/24", "dev", p.VethA)
	run("-n", p.B, "addr", "add", p.AddrB+"/24", "dev", p.VethB)
	for _, l := range [][2]string{{p.A, p.VethA}, {p.B, p.VethB}, {p.A, "lo"}, {p.B, "lo"}} {
		run("-n", l[0], "link", "set", l[1], "up")
	}
	t.Logf("network namespaces %s (%s) and %s (%s)", p.A, p.AddrA, p.B, p.AddrB)
	return p
}

// removeStaleNetns deletes namespaces that earlier test processes, now
// dead, left behind (killed before their cleanup ran).
func removeStaleNetns(ip string) {
	out, err := exec.Command(ip, "netns", "list").Output()
	if err != nil {
		return
	}
	for _, line := range strings.Split(string(out), "\n") {
		name, _, _ := strings.Cut(strings.TrimSpace(line), " ")
		rest, ok := strings.CutPrefix(name, netnsPrefix)
		if !ok {
			continue
		}
		pidStr, _, _ := strings.Cut(rest, "-")
		if pid, err := strconv.Atoi(pidStr); err == nil && pid != os.Getpid() && !pidExists(pid) {
			exec.Command(ip, "netns", "del", name).Run()
		}
	}
}

// NewNetns creates a network namespace of its own with its loopback up,
// deleted when the test ends; it returns its name (for InNetns).
func NewNetns(t testing.TB) string {
	t.Helper()
	if os.Geteuid() != 0 {
		missing(t, "network namespaces need root (euid %d)", os.Geteuid())
	}
	ip := NeedTool(t, "ip")
	removeStaleNetns(ip)
	ns := fmt.Sprintf("%s%d-%d-t", netnsPrefix, os.Getpid(), netSeq.Add(1))
	if out, err := exec.Command(ip, "netns", "add", ns).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add %s: %v: %s", ns, err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command(ip, "netns", "del", ns).CombinedOutput(); err != nil {
			t.Errorf("ip netns del %s: %v: %s", ns, err, out)
		}
	})
	IP(t, "-n", ns, "link", "set", "lo", "up")
	return ns
}

// InNetns runs fn on an OS thread inside network namespace ns: processes
// started from fn (exec.Cmd.Start) and sockets opened there belong to ns.
func InNetns(t testing.TB, ns string, fn func()) {
	t.Helper()
	InNetnsAt(t, filepath.Join("/run/netns", ns), fn)
}

// InNetnsAt is InNetns for the namespace at path (/proc/PID/ns/net).
func InNetnsAt(t testing.TB, path string, fn func()) {
	t.Helper()
	runtime.LockOSThread()
	self, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("own network namespace: %v", err)
	}
	defer self.Close()
	target, err := os.Open(path)
	if err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("network namespace %s: %v", path, err)
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), syscall.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("enter network namespace %s: %v", path, err)
	}
	defer func() {
		// Back to where the thread came from; if that fails the thread
		// stays locked and ends with this goroutine.
		if err := unix.Setns(int(self.Fd()), syscall.CLONE_NEWNET); err == nil {
			runtime.UnlockOSThread()
		}
	}()
	fn()
}

// IP runs ip with args, failing the test on error.
func IP(t testing.TB, args ...string) string {
	t.Helper()
	out, err := exec.Command(NeedTool(t, "ip"), args...).CombinedOutput()
	if err != nil {
		t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// Cut brings the link down on A's side: packets in both directions are
// dropped from then on, and neither side is told.
func (p *NetPair) Cut(t testing.TB) {
	t.Helper()
	IP(t, "-n", p.A, "link", "set", p.VethA, "down")
	t.Logf("link %s cut", p.VethA)
}

// Shape limits A's sending rate (a token bucket on A's veth).
func (p *NetPair) Shape(t testing.TB, rate string) {
	t.Helper()
	p.ShapeBurst(t, rate, "256kb")
}

// ShapeBurst is Shape with tbf's bucket: at 10gbit it must hold more than
// a timer tick's worth (1.25 MB at 1000 Hz), or the rate is not reached.
func (p *NetPair) ShapeBurst(t testing.TB, rate, burst string) {
	t.Helper()
	tc := NeedTool(t, "tc")
	if out, err := exec.Command(tc, "-n", p.A, "qdisc", "add", "dev", p.VethA, "root", "tbf", "rate", rate, "burst", burst, "latency", "200ms").CombinedOutput(); err != nil {
		t.Fatalf("tc qdisc add: %v: %s", err, out)
	}
}

// RxBytes is what B's veth has received so far.
func (p *NetPair) RxBytes(t testing.TB) int64 {
	t.Helper()
	lines := strings.Split(IP(t, "-n", p.B, "-s", "link", "show", p.VethB), "\n")
	for i, l := range lines {
		if strings.Contains(l, "RX:") && i+1 < len(lines) {
			if f := strings.Fields(lines[i+1]); len(f) > 0 {
				n, _ := strconv.ParseInt(f[0], 10, 64)
				return n
			}
		}
	}
	return 0
}

// NetnsOf says whether pid lives in network namespace ns.
func NetnsOf(pid int, ns string) (bool, error) {
	var a, b unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/net", pid), &a); err != nil {
		return false, err
	}
	if err := unix.Stat(filepath.Join("/run/netns", ns), &b); err != nil {
		return false, err
	}
	return a.Ino == b.Ino && a.Dev == b.Dev, nil
}
