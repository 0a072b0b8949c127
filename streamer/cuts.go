package streamer

// Files cut where their producer says, not by content: the fast path's
// VRAM files of a --dedup checkpoint (vram/storecut.go), cut at the
// device blocks' boundaries so that an unchanged range is the same chunks
// in every checkpoint. Such a chunk that the output holds already is
// named by its id and never read: the producer knows it from an earlier
// checkpoint's manifest.

import (
	"context"
	"fmt"
	"iter"
	"sync"

	"github.com/gpucr/gpucr-stream/manifest"
)

// A Cut is one chunk of a file that WriteCuts writes: Len bytes, at most
// the chunk size.
type Cut struct {
	Len int
	// Fill reads the chunk's bytes into b (Len bytes). Nil for a chunk
	// the output holds (Knows said so): Hash and CRC are then its content
	// id and CRC-32C, as its earlier manifest lists them.
	Fill func(b []byte) error
	Hash [32]byte
	CRC  uint32
	// Visit, if set, sees the chunk's bytes on a worker before they are
	// encoded (every core at once).
	Visit func(b []byte)
}

// Knows says the output holds the chunk id already, so that a Cut may
// name it without its bytes: an output that deduplicates, unless the
// capture is encrypted (its ids are keyed, and an id known from a plain
// manifest is not one of them).
func (c *Capture) Knows(id [32]byte) bool { return c.knows != nil && c.seal == nil && c.knows(id) }

// ChunkSize is the largest chunk (a Cut's Len at most).
func (c *Capture) ChunkSize() int { return c.opts.ChunkSize }

// WriteCuts writes the external file name as the chunks cuts yields, in
// order, in the background (WriteBackground: it is the fast path's store).
// It returns the file's size once every chunk's Visit has run, or an error
// (also where one was not run: the capture stopped first).
func (c *Capture) WriteCuts(name string, cuts iter.Seq2[Cut, error]) (int64, error) {
	id, err := c.openFile(name, manifest.FileFlagExternal)
	if err != nil {
		return 0, err
	}
	var visits sync.WaitGroup
	var off int64
	var chunks uint32
	err = func() error {
		for cut, err := range cuts {
			if err != nil {
				return err
			}
			it, err := c.cutItem(&cut, id, name, off, &visits)
			if err != nil {
				return err
			}
			if err := c.submit(it); err != nil {
				return err
			}
			off += int64(cut.Len)
			chunks++
			c.Counters.RawBytes.Add(int64(cut.Len))
		}
		return c.submit(&item{kind: manifest.FrameFileEnd, fileID: id, name: name, size: off, chunks: chunks})
	}()
	visits.Wait()
	if err == nil && c.ctx.Err() != nil {
		err = context.Cause(c.ctx) // some chunk was never visited
	}
	return off, err
}

// cutItem is the DATA item of cut at off of file id: a known chunk, or
// its bytes read into a budgeted buffer.
func (c *Capture) cutItem(cut *Cut, id uint32, name string, off int64, visits *sync.WaitGroup) (*item, error) {
	if cut.Len <= 0 || cut.Len > c.opts.ChunkSize {
		return nil, fmt.Errorf("capture: %s at offset %d: a chunk of %d bytes (the chunk size is %d)", name, off, cut.Len, c.opts.ChunkSize)
	}
	it := &item{kind: manifest.FrameData, fileID: id, name: name, off: off, rawLen: cut.Len}
	if cut.Fill == nil {
		if !c.Knows(cut.Hash) {
			return nil, fmt.Errorf("capture: %s at offset %d: chunk %x is not held by the output", name, off, cut.Hash)
		}
		it.known, it.hash, it.crc = true, cut.Hash, cut.CRC
		return it, nil
	}
	buf, err := c.chunkBuf(it, true)
	if err != nil {
		return nil, err
	}
	it.raw = buf[:cut.Len]
	if err := cut.Fill(it.raw); err != nil {
		c.release(it)
		return nil, fmt.Errorf("read %s at offset %d: %w", name, off, err)
	}
	it.sums.zero = true
	it.sums.add(it.raw)
	if cut.Visit != nil {
		visits.Add(1)
		it.visit, it.visited = cut.Visit, visits
	}
	return it, nil
}

// visitDone counts a WriteCuts chunk done, visited or not (the capture
// stopped first).
func (it *item) visitDone() {
	if it.visited != nil {
		it.visited.Done()
		it.visited = nil
	}
}
