package vram

// The store lends the capture its kept files, mapped (streamer.Lender):
// reading them into chunk buffers was a copy of every byte, beside CRIU's
// dump, which waits for the same memory bandwidth. Each lent stretch is
// populated first (MADV_POPULATE_READ), so that a page the kernel cannot
// give is an error of the read here, never a fault in whatever goroutine
// touches it next; where the kernel has no MADV_POPULATE_READ (before
// 5.14) the file is read as before.

import (
	"context"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// keptMap is a kept file mapped read-only, lent from off on.
type keptMap struct {
	ctx  context.Context
	name string
	data []byte
	off  int
}

// mapKept maps f, or returns nil where it cannot (an empty file, a kernel
// without MADV_POPULATE_READ, no address space): then f is read.
func mapKept(ctx context.Context, f *os.File) *keptMap {
	st, err := f.Stat()
	if err != nil || st.Size() == 0 || int64(int(st.Size())) != st.Size() {
		return nil
	}
	data, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil
	}
	m := &keptMap{ctx: ctx, name: f.Name(), data: data}
	if unix.Madvise(data[:min(len(data), 4096)], unix.MADV_POPULATE_READ) != nil {
		m.unmap()
		return nil
	}
	return m
}

func (m *keptMap) unmap() {
	if m.data != nil {
		_ = unix.Munmap(m.data)
		m.data = nil
	}
}

// Lend implements streamer.Lender.
func (m *keptMap) Lend(n int) ([]byte, error) {
	if err := m.ctx.Err(); err != nil {
		return nil, context.Cause(m.ctx)
	}
	if m.off >= len(m.data) {
		return nil, io.EOF
	}
	end := min(m.off+n, len(m.data))
	b := m.data[m.off:end]
	// madvise takes whole pages: from the one b starts in.
	if err := unix.Madvise(m.data[m.off&^(os.Getpagesize()-1):end], unix.MADV_POPULATE_READ); err != nil {
		return nil, fmt.Errorf("%s at offset %d: %w", m.name, m.off, err)
	}
	m.off += len(b)
	return b, nil
}

// Read is Lend's copy, for a writer that does not borrow.
func (m *keptMap) Read(p []byte) (int, error) {
	b, err := m.Lend(len(p))
	return copy(p, b), err
}
