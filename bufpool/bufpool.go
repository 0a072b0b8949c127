// Package bufpool keeps large buffers of one size for reuse: the chunk
// buffers of a capture and the parts of an S3 upload, which must not be
// made again after every garbage collection.
package bufpool

import (
	"sync"
	"sync/atomic"
)

// Pool is a free list of buffers of one size. Unlike a sync.Pool it
// keeps its buffers across garbage collections: a pipeline that gives them
// back makes no garbage, so its heap stays at the most buffers it ever had
// in use instead of being refilled after every collection, and nothing
// accumulates between collections however many bytes pass through. It
// keeps at most the idle count given to New; Get allocates when
// none is free. The last buffer given back is the first handed out: it is
// the likeliest to be still in the cache.
type Pool struct {
	size      int
	idle      int
	mu        sync.Mutex
	free      [][]byte
	allocated atomic.Int64
}

// New returns a pool of size-byte buffers that keeps at most idle of them.
func New(size, idle int) *Pool {
	return &Pool{size: size, idle: idle}
}

// Get returns a buffer of the pool's size, its contents undefined.
func (p *Pool) Get() []byte {
	if b, ok := p.TryGet(); ok {
		return b
	}
	p.allocated.Add(1)
	return make([]byte, p.size)
}

// Allocated is how many buffers Get has made: as many as were ever in use
// at once, if they all came back.
func (p *Pool) Allocated() int64 { return p.allocated.Load() }

// TryGet returns a free buffer, if there is one, without allocating.
func (p *Pool) TryGet() ([]byte, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	k := len(p.free)
	if k == 0 {
		return nil, false
	}
	b := p.free[k-1]
	p.free[k-1] = nil
	p.free = p.free[:k-1]
	return b[:p.size], true
}

// Put gives back a buffer Get returned (any slice of it). Others, nil
// included, are ignored, as is a buffer beyond the idle count.
func (p *Pool) Put(b []byte) {
	if cap(b) != p.size {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.free) < p.idle {
		p.free = append(p.free, b[:p.size])
	}
}
