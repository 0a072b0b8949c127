package tcp

// Design: a flood of connections that never authenticate must not starve
// the sender that does, however many addresses it comes from. The budget
// is global (maxPreAuth) and per address (maxPreAuthPerSource); when a
// connection does not fit, one already held goes, chosen by how far it
// got: first the oldest that has sent nothing at all (the kernel's count
// of bytes received, TCP_INFO, so a sender whose handshake goroutine has
// not run yet still counts as talking), then the oldest that has sent
// bytes but not finished TLS, then the oldest that finished TLS. The
// newcomer is never the one dropped: a new connection always gets its
// chance. A real sender sends its ClientHello the moment it connects and
// its hello right after TLS, so idle peers, from any number of addresses,
// only ever evict each other; peers that send a few bytes and stall
// evict each other before a sender that finished TLS.

import (
	"net"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Limits on peers that have not authenticated yet.
const (
	// preAuthTimeout bounds the TLS handshake and the hello.
	preAuthTimeout = 5 * time.Second
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
// source when it is over its share, else one of all when there are too
// many; never c itself.
func (p *preAuth) add(c net.Conn) (evict net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	src := sourceOf(c)
	p.conns = append(p.conns, &preConn{c: c, src: src})
	p.bySource[src]++
	var victim *preConn
	switch {
	case p.bySource[src] > p.per:
		victim = p.victimLocked(src)
	case len(p.conns) > p.max:
		victim = p.victimLocked("")
	}
	if victim == nil {
		return nil
	}
	p.removeLocked(victim.c)
	return victim.c
}

// victimLocked picks the connection to drop among those of src ("" means
// all) but the newest: the oldest of the least advanced stage.
func (p *preAuth) victimLocked(src string) *preConn {
	held := p.conns[:len(p.conns)-1]
	var best *preConn
	for _, pc := range held {
		if src != "" && pc.src != src {
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
