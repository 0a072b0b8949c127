package streamer

// Lent files: the fast path's store reads its kept copy (tens of GB in a
// tmpfs) into chunk buffers, a copy of every byte that measured 23% of the
// store's CPU on the GPU host, and memory bandwidth that CRIU's dump beside
// it waits for. A reader that has the file's bytes in memory already (the
// kept file, mapped) lends them instead: each chunk's raw bytes are the
// lender's memory, summed as they are and written from there. The chunk
// still takes a token, so the flow is the same; it has no buffer to give
// back. The write returns only once no chunk of the file is referenced:
// every lent item has been released (written, or dropped by a failing
// pipeline, which still releases every item), so the caller may unmap.

import (
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/gpucr/gpucr-stream/manifest"
)

// A Lender is a reader whose bytes are in memory already.
type Lender interface {
	io.Reader
	// Lend consumes and returns the next n bytes (fewer at the end; none,
	// with io.EOF, after it), memory nobody writes until the write that
	// lends them returns.
	Lend(n int) ([]byte, error)
}

// lends says whether a file read from r is written from r's memory: not
// where chunks are cut by content (they are read), nor sealed ones (the
// seal is written over the raw bytes).
func (c *Capture) lends(r io.Reader) (Lender, bool) {
	l, ok := r.(Lender)
	return l, ok && c.seal == nil && c.knows == nil
}

// writeLent is writeFile's loop for a Lender: file id is open.
func (c *Capture) writeLent(id uint32, name string, l Lender, background bool) (int64, error) {
	var off int64
	var chunks uint32
	var lent sync.WaitGroup
	defer lent.Wait()
	for {
		it := &item{kind: manifest.FrameData, fileID: id, name: name, off: off}
		if err := c.acquire(background); err != nil {
			return off, err
		}
		it.token, it.background = true, background
		b, err := l.Lend(c.opts.ChunkSize)
		eof := errors.Is(err, io.EOF)
		if len(b) == 0 || (err != nil && !eof) {
			c.release(it)
			if eof {
				break
			}
			if err == nil {
				err = io.ErrNoProgress
			}
			return off, fmt.Errorf("read %s at offset %d: %w", name, off, err)
		}
		it.raw, it.rawLen = b, len(b)
		it.sums.zero = true
		it.sums.add(b)
		lent.Add(1)
		it.lent = &lent
		if err := c.submit(it); err != nil {
			return off, err
		}
		off += int64(len(b))
		chunks++
		c.Counters.RawBytes.Add(int64(len(b)))
		if eof {
			break
		}
	}
	return off, c.submit(&item{kind: manifest.FrameFileEnd, fileID: id, name: name, size: off, chunks: chunks})
}
