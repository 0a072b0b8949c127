package main

// What the target holds on request beside its memory, for the tests of the
// images CRIU reads as files (issue 39): a mapping of huge pages (--hugetlb),
// which CRIU restores from a second read of the pages image, and a TCP
// connection with bytes in flight both ways (--tcp-pair), which CRIU
// restores under its network lock.

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"syscall"
	"time"
)

// hugeRegion maps mb MiB of private anonymous huge pages (MAP_HUGETLB),
// filled with random bytes. The test reserves them (vm.nr_hugepages).
func hugeRegion(mb int) ([]byte, error) {
	b, err := syscall.Mmap(-1, 0, mb<<20, syscall.PROT_READ|syscall.PROT_WRITE,
		syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS|syscall.MAP_HUGETLB)
	if err != nil {
		return nil, fmt.Errorf("map %d MiB of huge pages (are they reserved? /proc/sys/vm/nr_hugepages): %w", mb, err)
	}
	r := rand.New(rand.NewPCG(0x4875, 0x6765))
	for i := 0; i+8 <= len(b); i += 8 {
		v := r.Uint64()
		for k := range 8 {
			b[i+k] = byte(v >> (8 * k))
		}
	}
	return b, nil
}

// tcpPair is a connection over loopback between two sockets of the
// target, a and b. Between proofs a batch of bytes is in flight from a to
// b (until a's write stalls: b's receive queue and a's send queue full)
// and a short message from b to a; each proof reads and checks them, runs
// a round trip, and sends the next batch.
type tcpPair struct {
	a, b  *net.TCPConn
	batch uint64
	sent  int64  // bytes of this batch written by a
	back  []byte // the message from b
}

func newTCPPair() (*tcpPair, error) {
	l, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return nil, err
	}
	defer l.Close()
	a, err := net.DialTCP("tcp4", nil, l.Addr().(*net.TCPAddr))
	if err != nil {
		return nil, err
	}
	b, err := l.AcceptTCP()
	if err != nil {
		return nil, err
	}
	p := &tcpPair{a: a, b: b}
	return p, p.fill()
}

// patternAt is byte i of batch n.
func patternAt(n uint64, i int64) byte {
	x := (uint64(i) ^ n<<44) * 0x9e3779b97f4a7c15
	return byte(x >> 56)
}

// stallAfter ends a batch: a write of a that has not finished by then
// found the queues full.
const stallAfter = 200 * time.Millisecond

func (p *tcpPair) fill() error {
	p.batch++
	p.sent = 0
	buf := make([]byte, 64<<10)
	for p.sent < 64<<20 {
		for i := range buf {
			buf[i] = patternAt(p.batch, p.sent+int64(i))
		}
		p.a.SetWriteDeadline(time.Now().Add(stallAfter))
		k, err := p.a.Write(buf)
		p.sent += int64(k)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			break
		}
		if err != nil {
			return fmt.Errorf("tcp batch %d: write: %w", p.batch, err)
		}
	}
	p.a.SetWriteDeadline(time.Time{})
	p.back = fmt.Appendf(nil, "batch %d back", p.batch)
	if _, err := p.b.Write(p.back); err != nil {
		return fmt.Errorf("tcp batch %d: write back: %w", p.batch, err)
	}
	return nil
}

// check reads the batch in flight both ways and checks every byte, runs a
// round trip, then sends the next batch; it returns the bytes checked.
func (p *tcpPair) check() (int64, error) {
	// Bytes already in flight: only a broken connection takes this long.
	deadline := time.Now().Add(time.Minute)
	p.a.SetReadDeadline(deadline)
	p.b.SetReadDeadline(deadline)
	buf := make([]byte, 64<<10)
	for off := int64(0); off < p.sent; {
		k, err := p.b.Read(buf[:min(int64(len(buf)), p.sent-off)])
		for i := range k {
			if buf[i] != patternAt(p.batch, off+int64(i)) {
				return 0, fmt.Errorf("tcp batch %d: byte %d of %d differs", p.batch, off+int64(i), p.sent)
			}
		}
		off += int64(k)
		if err != nil {
			return 0, fmt.Errorf("tcp batch %d: read at %d of %d: %w", p.batch, off, p.sent, err)
		}
	}
	back := make([]byte, len(p.back))
	if _, err := io.ReadFull(p.a, back); err != nil || string(back) != string(p.back) {
		return 0, fmt.Errorf("tcp batch %d: read back %q (%v), want %q", p.batch, back, err, p.back)
	}
	ping := fmt.Appendf(nil, "ping %d", p.batch)
	if _, err := p.a.Write(ping); err != nil {
		return 0, fmt.Errorf("tcp ping: %w", err)
	}
	got := make([]byte, len(ping))
	if _, err := io.ReadFull(p.b, got); err != nil || string(got) != string(ping) {
		return 0, fmt.Errorf("tcp ping: read %q (%v), want %q", got, err, ping)
	}
	n := p.sent + int64(len(back)+len(ping))
	return n, p.fill()
}
