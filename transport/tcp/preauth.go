package tcp

import (
	"net"
	"sync"
	"time"
)

// Limits on peers that have not authenticated yet.
const (
	// preAuthTimeout bounds the TLS handshake and the hello.
	preAuthTimeout = 5 * time.Second
	// maxPreAuth connections are handshaking at once; beyond it the
	// oldest is dropped.
	maxPreAuth = 256
	// maxPreAuthPerSource: one address gets as many as a sender's streams;
	// beyond it that address's oldest is dropped.
	maxPreAuthPerSource = MaxStreams
)

// preAuth tracks the connections that are still handshaking, oldest
// first, so that a flood of silent peers evicts itself rather than the
// real sender that connects after it.
type preAuth struct {
	mu       sync.Mutex
	max, per int
	conns    []net.Conn // in arrival order
	bySource map[string]int
}

func newPreAuth(max, per int) *preAuth {
	return &preAuth{max: max, per: per, bySource: map[string]int{}}
}

func sourceOf(c net.Conn) string {
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		return a.IP.String()
	}
	return c.RemoteAddr().String()
}

// add registers c and returns the connection to drop, if any: the oldest
// of c's source when it is over its share, else the oldest of all when
// there are too many.
func (p *preAuth) add(c net.Conn) (evict net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	src := sourceOf(c)
	p.conns = append(p.conns, c)
	p.bySource[src]++
	if p.bySource[src] > p.per {
		for _, o := range p.conns {
			if sourceOf(o) == src {
				evict = o
				break
			}
		}
	} else if len(p.conns) > p.max {
		evict = p.conns[0]
	}
	if evict != nil {
		p.removeLocked(evict)
	}
	return evict
}

func (p *preAuth) remove(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.removeLocked(c)
}

func (p *preAuth) removeLocked(c net.Conn) {
	for i, o := range p.conns {
		if o == c {
			p.conns = append(p.conns[:i], p.conns[i+1:]...)
			src := sourceOf(c)
			if p.bySource[src]--; p.bySource[src] == 0 {
				delete(p.bySource, src)
			}
			return
		}
	}
}
