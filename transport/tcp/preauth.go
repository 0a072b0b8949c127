package tcp

// Design: a flood of connections that never authenticate must not starve
// the sender that does, however many addresses it comes from. The budget
// is global (maxPreAuth) and per address (maxPreAuthPerSource); when a
// connection does not fit, one already held goes: one of its own
// address's when that address is over its share, else one of the address
// that holds the most (a flood of 300 connections from 40 addresses holds
// 7 or 8 each, a 4-stream sender 4, so the flood drops its own). Within
// that address it is chosen by how far it got: first the oldest that has
// sent nothing at all (the kernel's count of bytes received, TCP_INFO, so
// a sender whose handshake goroutine has not run yet still counts as
// talking), then the oldest that has sent bytes but not finished TLS, then
// the oldest that finished TLS. The newcomer is never the one dropped: a
// new connection always gets its chance. A connection that finished TLS
// has helloTimeout left to send its hello, which a real sender sends at
// once: a flood that completes TLS handshakes (with no token, anyone can)
// holds each slot for moments. A sender whose connection still goes (a
// flood from more addresses than it has streams) retries it (send.go).

import (
	"fmt"
	"net"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Limits on peers that have not authenticated yet.
const (
	// preAuthTimeout bounds the TLS handshake and the hello.
	preAuthTimeout = 5 * time.Second
	// helloTimeout bounds the wait for the hello once TLS is done: a real
	// sender writes it right after its side of the handshake.
	helloTimeout = 2 * time.Second
	// maxPreAuth connections are handshaking at once; beyond it one is
	// dropped (see the design note).
	maxPreAuth = 256
	// maxPreAuthPerSource: one address gets as many as a sender's streams;
	// beyond it one of that address's is dropped.
	maxPreAuthPerSource = MaxStreams
)

// Stages of a connection before authentication, in the order eviction
// spares them.
const (
	stageIdle  = iota // nothing received
	stageBytes        // bytes received, TLS not finished
	stageTLS          // TLS finished, hello pending
)

// preAuth tracks the connections that are still handshaking, oldest
// first.
type preAuth struct {
	mu       sync.Mutex
	max, per int
	conns    []*preConn // in arrival order
	bySource map[string]int
	// received reports whether c has received any byte (a variable for
	// tests with connections that have no socket).
	received func(c net.Conn) bool
}

type preConn struct {
	c     net.Conn
	src   string
	stage int
}

func newPreAuth(max, per int) *preAuth {
	return &preAuth{max: max, per: per, bySource: map[string]int{}, received: bytesReceived}
}

func sourceOf(c net.Conn) string {
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		return a.IP.String()
	}
	return c.RemoteAddr().String()
}

// bytesReceived asks the kernel whether any byte arrived on c, read or
// not; a connection it cannot ask about counts as talking.
func bytesReceived(c net.Conn) bool {
	sc, ok := c.(interface {
		SyscallConn() (syscall.RawConn, error)
	})
	if !ok {
		return true
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return true
	}
	got := true
	_ = rc.Control(func(fd uintptr) {
		if ti, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			got = ti.Bytes_received > 0
		}
	})
	return got
}

// add registers c and returns the connection to drop, if any: one of c's
// source when it is over its share, else, when there are too many, one of
// the sources that hold the most; never c itself.
func (p *preAuth) add(c net.Conn) (evict net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	src := sourceOf(c)
	p.conns = append(p.conns, &preConn{c: c, src: src})
	p.bySource[src]++
	var victim *preConn
	switch {
	case p.bySource[src] > p.per:
		victim = p.victimLocked(func(s string) bool { return s == src })
	case len(p.conns) > p.max:
		most := 0
		for _, n := range p.bySource {
			most = max(most, n)
		}
		victim = p.victimLocked(func(s string) bool { return p.bySource[s] == most })
	}
	if victim == nil {
		return nil
	}
	p.removeLocked(victim.c)
	return victim.c
}

// victimLocked picks the connection to drop among those of the sources
// from accepts but the newest: the oldest of the least advanced stage.
func (p *preAuth) victimLocked(from func(src string) bool) *preConn {
	held := p.conns[:len(p.conns)-1]
	var best *preConn
	for _, pc := range held {
		if !from(pc.src) {
			continue
		}
		if pc.stage == stageIdle && p.received(pc.c) {
			pc.stage = stageBytes // it only ever advances: asked once
		}
		if pc.stage == stageIdle {
			return pc // the oldest idle: none goes before it
		}
		if best == nil || pc.stage < best.stage {
			best = pc
		}
	}
	return best
}

// tlsDone records that c finished its TLS handshake.
func (p *preAuth) tlsDone(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pc := range p.conns {
		if pc.c == c {
			pc.stage = stageTLS
			return
		}
	}
}

func (p *preAuth) remove(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.removeLocked(c)
}

func (p *preAuth) removeLocked(c net.Conn) {
	for i, pc := range p.conns {
		if pc.c == c {
			p.conns = append(p.conns[:i], p.conns[i+1:]...)
			if p.bySource[pc.src]--; p.bySource[pc.src] == 0 {
				delete(p.bySource, pc.src)
			}
			return
		}
	}
}

// dropLog logs the peers turned away before they authenticated: the
// first few of each interval in full (a sender with the wrong token, a
// port scanner), the others as one line of counts by reason once the
// interval is over (one line each, a flood wrote 15,000 to 60,000 lines in
// 10 s).
type dropLog struct {
	log   func(string)
	every time.Duration
	burst int              // lines in full per interval
	now   func() time.Time // time.Now; a variable for tests
	mu    sync.Mutex
	since time.Time // when the interval being counted began
	full  int       // lines logged in full since then
	// counts are the peers turned away since then and not logged, by
	// reason (a few fixed strings).
	counts map[string]int
}

func newDropLog(log func(string), every time.Duration, burst int) *dropLog {
	return &dropLog{log: log, every: every, burst: burst, now: time.Now, counts: map[string]int{}}
}

// add notes one peer turned away for reason; line says it in full.
func (d *dropLog) add(reason, line string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := d.now()
	if d.since.IsZero() || now.Sub(d.since) >= d.every {
		d.flushLocked(now)
		d.since, d.full = now, 0
	}
	if d.full < d.burst {
		d.full++
		d.log(line)
		return
	}
	d.counts[reason]++
}

// flush logs the counts once their interval is over, or with all, now.
func (d *dropLog) flush(all bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if now := d.now(); all || now.Sub(d.since) >= d.every {
		d.flushLocked(now)
	}
}

func (d *dropLog) flushLocked(now time.Time) {
	if len(d.counts) == 0 {
		return
	}
	reasons := make([]string, 0, len(d.counts))
	total := 0
	for r, n := range d.counts {
		reasons = append(reasons, fmt.Sprintf("%d %s", n, r))
		total += n
	}
	sort.Strings(reasons)
	d.log(fmt.Sprintf("refused %d more unauthenticated connection(s) in %v: %s", total, now.Sub(d.since).Round(time.Millisecond), strings.Join(reasons, ", ")))
	clear(d.counts)
}
