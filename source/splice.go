package source

import (
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"syscall"
	"unsafe"

	"github.com/gpucr/gpucr-stream/knobs"
	"golang.org/x/sys/unix"
)

// Serving into CRIU's pipe is the serial step of a restore: write(2) copies
// every byte into pipe pages that CRIU then copies again. vmsplice(2) puts
// references to our own pages into the pipe instead, which doubles what one
// pipe carries. The price is that a page handed to a pipe may be read at any
// later time (by CRIU, or by whatever the reader splices it on to), so a
// spliced buffer is never written again: it is unmapped, and the pipe's
// references keep its pages alive until they are read. Such buffers are
// therefore mmap'd outside Go's heap, which would reuse them.

// hugePage aligns page buffers so that the kernel can back them with
// transparent huge pages: mapping, filling and unmapping 4 MiB costs a
// tenth of what it does in 4 KiB pages.
const hugePage = 2 << 20

// minSpliceChunk: smaller chunks (the small image files, the tails of
// pages files) are not worth a mapping of their own and are written.
const minSpliceChunk = 1 << 20

// pageBuf is a buffer of whole pages of its own mapping.
type pageBuf struct {
	mapping []byte // what munmap takes
	b       []byte // the usable, huge-page aligned part
	file    bool   // an unlinked spill file's pages (newFileBuf): never pooled
}

func roundHuge(n int) int { return (n + hugePage - 1) &^ (hugePage - 1) }

func newPageBuf(size int) (*pageBuf, error) {
	n := roundHuge(size)
	m, err := unix.Mmap(-1, 0, n+hugePage, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("map a %d-byte buffer: %w", n, err)
	}
	off := 0
	if a := addr(m) % hugePage; a != 0 {
		off = int(hugePage - a)
	}
	b := m[off : off+n]
	_ = unix.Madvise(b, unix.MADV_HUGEPAGE) // a hint; without it, small pages
	return &pageBuf{mapping: m, b: b}, nil
}

// newFileBuf is a pageBuf of size bytes whose pages are those of an
// unlinked file in dir (a frame the memory budget has no room for:
// inflight.go). Its blocks are allocated first, so that a full disk is an
// error here and never a SIGBUS when the mapping is written.
func newFileBuf(dir string, size int) (*pageBuf, error) {
	f, err := os.CreateTemp(dir, "gpucr-frame-*")
	if err != nil {
		return nil, fmt.Errorf("spill file: %w", err)
	}
	defer f.Close() // the mapping keeps the pages
	os.Remove(f.Name())
	n := max(os.Getpagesize(), (size+os.Getpagesize()-1)&^(os.Getpagesize()-1))
	if err := unix.Fallocate(int(f.Fd()), 0, 0, int64(n)); err != nil {
		return nil, fmt.Errorf("spill file %s: allocate %d bytes: %w", f.Name(), n, err)
	}
	m, err := unix.Mmap(int(f.Fd()), 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("spill file %s: map %d bytes: %w", f.Name(), n, err)
	}
	return &pageBuf{mapping: m, b: m, file: true}, nil
}

func addr(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

func (p *pageBuf) free() { _ = unix.Munmap(p.mapping) }

// trim gives back the pages past the huge pages that n bytes need: a
// chunk kept in a larger buffer (the pool's) holds only what it counts.
func (p *pageBuf) trim(n int) {
	if k := roundHuge(n); k < len(p.b) && !p.file {
		_ = unix.Madvise(p.b[k:], unix.MADV_DONTNEED)
	}
}

// pagePool keeps page buffers that were written out by copying, for reuse;
// a spliced buffer is freed instead (see above).
type pagePool struct {
	size int // the buffers' length
	keep int // at most this many are kept free
	mu   sync.Mutex
	free []*pageBuf
}

func (p *pagePool) get(n int) (*pageBuf, error) {
	if n <= p.size {
		p.mu.Lock()
		if k := len(p.free); k > 0 {
			b := p.free[k-1]
			p.free = p.free[:k-1]
			p.mu.Unlock()
			return b, nil
		}
		p.mu.Unlock()
	}
	return newPageBuf(max(n, p.size))
}

func (p *pagePool) put(b *pageBuf) {
	p.mu.Lock()
	if !b.file && len(b.b) == roundHuge(p.size) && len(p.free) < p.keep {
		p.free = append(p.free, b)
		b = nil
	}
	p.mu.Unlock()
	if b != nil {
		b.free()
	}
}

// close frees the kept buffers.
func (p *pagePool) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, b := range p.free {
		b.free()
	}
	p.free = nil
}

// zeroPages is a read-only mapping never written: the kernel backs it with
// the shared zero page, so splicing it hands out zeros without copying any.
var zeroPages = sync.OnceValues(func() ([]byte, error) {
	return unix.Mmap(-1, 0, 4<<20, unix.PROT_READ, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
})

// chunkWriter writes decoded chunks to w: by vmsplice when w is a pipe,
// by Write otherwise; zero runs into a regular file become holes.
type chunkWriter struct {
	w    io.Writer
	pipe syscall.RawConn // nil unless w is a pipe
	file *os.File        // w, when it is a regular file written at its offset
	omit *Omit           // the bytes it leaves out, when Copy was handed an Omit
}

// noSplice turns splicing off, to measure what it saves
// (GPUCR_NO_SPLICE=1).
var noSplice = knobs.NoSplice.On()

func newChunkWriter(w io.Writer) chunkWriter {
	if o, ok := w.(*Omit); ok {
		cw := newChunkWriter(o.W)
		cw.omit = o
		return cw
	}
	f, ok := w.(*os.File)
	if !ok {
		return chunkWriter{w: w}
	}
	fi, err := f.Stat()
	if err == nil && fi.Mode().IsRegular() {
		// O_APPEND ignores the offset: zeros must be written there.
		if fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0); err == nil && fl&unix.O_APPEND == 0 {
			return chunkWriter{w: w, file: f}
		}
	}
	if err != nil || fi.Mode()&os.ModeNamedPipe == 0 || noSplice {
		return chunkWriter{w: w}
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return chunkWriter{w: w}
	}
	return chunkWriter{w: w, pipe: rc}
}

// write writes the pieces of bs in order, each in a pageBuf. It reports
// whether the pipe took references to their pages, in which case they must
// never be written again.
func (cw chunkWriter) write(bs ...[]byte) (spliced bool, err error) {
	if cw.omit != nil {
		bs = cw.omit.kept(bs)
	}
	if cw.pipe == nil {
		for _, b := range bs {
			if _, err := cw.w.Write(b); err != nil {
				return false, err
			}
		}
		return false, nil
	}
	n, err := cw.vmsplice(bs...)
	return n > 0, err
}

// zeros writes n zero bytes.
func (cw chunkWriter) zeros(n int64) error {
	if o := cw.omit; o != nil {
		cw.omit = nil
		return o.keep(n, func(from, to int64) error { return cw.zeros(to - from) })
	}
	if cw.file != nil && n > 0 {
		// A hole, ended by one written zero so that the length is right
		// even when the file ends here: declared zeros cost no space.
		if _, err := cw.file.Seek(n-1, io.SeekCurrent); err != nil {
			return err
		}
		_, err := cw.file.Write(zeros[:1])
		return err
	}
	z, err := zeroPages()
	if cw.pipe == nil || err != nil {
		return writeZeros(cw.w, n)
	}
	return zeroRuns(z, n, func(b []byte) error { _, err := cw.vmsplice(b); return err })
}

// fromFile writes n bytes of f from offset off. Into a pipe it splices
// them out of the page cache, so they are never copied; f must not be
// written over at that range while the pipe may still hold them (spill
// files are append-only).
func (cw chunkWriter) fromFile(f *os.File, off, n int64, buf []byte) error {
	if o := cw.omit; o != nil {
		cw.omit = nil
		return o.keep(n, func(from, to int64) error { return cw.fromFile(f, off+from, to-from, buf) })
	}
	if cw.pipe == nil {
		if _, err := f.ReadAt(buf[:n], off); err != nil {
			return err
		}
		_, err := cw.w.Write(buf[:n])
		return err
	}
	src := int(f.Fd())
	end := off + n
	var serr error
	err := cw.pipe.Write(func(fd uintptr) bool {
		for off < end {
			k, err := unix.Splice(src, &off, int(fd), nil, int(end-off), unix.SPLICE_F_MOVE) // a non-blocking pipe makes it non-blocking
			switch {
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				return false // the pipe is full: wait until writable
			case err != nil:
				serr = err
				return true
			case k == 0:
				serr = io.ErrUnexpectedEOF
				return true
			}
		}
		return true
	})
	if serr != nil {
		err = serr
	}
	if err != nil {
		return fmt.Errorf("splice from %s at offset %d: %w", f.Name(), off, err)
	}
	return nil
}

// vmsplice hands all of bs to the pipe, waiting for room as a write does:
// one call for many pieces (a run's chunks), as for one.
func (cw chunkWriter) vmsplice(bs ...[]byte) (int, error) {
	iov := make([]unix.Iovec, 0, len(bs))
	for _, b := range bs {
		if len(b) > 0 {
			iov = append(iov, unix.Iovec{Base: &b[0]})
			iov[len(iov)-1].SetLen(len(b))
		}
	}
	done := 0
	var serr error
	err := cw.pipe.Write(func(fd uintptr) bool {
		for len(iov) > 0 {
			// At most UIO_MAXIOV pieces a call.
			n, err := unix.Vmsplice(int(fd), iov[:min(len(iov), 1024)], 0)
			switch {
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				return false // a non-blocking pipe: wait until writable
			case err != nil:
				serr = err
				return true
			}
			done += n
			for n > 0 {
				if k := int(iov[0].Len); n >= k {
					iov, n = iov[1:], n-k
				} else {
					iov[0].Base = (*byte)(unsafe.Add(unsafe.Pointer(iov[0].Base), n))
					iov[0].SetLen(k - n)
					n = 0
				}
			}
		}
		return true
	})
	if serr != nil {
		err = serr
	}
	if err != nil {
		if errors.Is(err, unix.EPIPE) {
			err = fmt.Errorf("%w (the reader closed the pipe)", err)
		}
		return done, fmt.Errorf("vmsplice: %w", err)
	}
	return done, nil
}
