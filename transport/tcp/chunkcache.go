package tcp

// The receiver's chunk cache (pre-copy, wire/chunk.go): the chunks a
// sender sends while its process still runs, by content id, in memory up
// to a budget and beyond it in an unlinked file of the spill directory.
// The stream's REF records are resolved from it; it is freed once the
// stream has been read, whatever its outcome. A REF on one connection may
// name a chunk sent on another whose reader has not got to it yet: a
// chunk not held waits until every connection's reader has begun its
// stream (each sends all its chunks first), and only then is refused.
//
// Memory: the rounds of a GPU process send tens of GB into the cache, and
// reading each chunk into fresh memory of its own made the readers fault
// in every page as they copied (on the 2xH200 host the receiver's copies
// ran at about 1.4 GB/s a core, half of its CPU time). So the readers read
// CHUNK records into slabs (alloc) that a goroutine of the cache allocates
// ahead, asks for in huge pages and faults in, off the readers' path.
//
// The budget counts each chunk's record too (chunkRecord), whether the
// chunk is in memory or spilled: a million small chunks took 157 MiB of
// records over a 1 MiB limit. Chunk bytes stay out of the last eighth of
// the budget (dataLimit), so that records still fit once the data has
// filled the rest; a cache whose records would pass the limit fails the
// stream, naming it.

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/transport/tcp/wire"
)

type cachedChunk struct {
	codec       uint8
	raw, crc    uint32
	stored      []byte // in memory, or
	off, length int64  // in the spill file
}

// chunkRecord is what one chunk's record holds besides its bytes, counted
// generously: the entry (rounded up by the allocator), its key and
// pointer in the map, and the map's room to grow.
const chunkRecord = 2 * (int64(unsafe.Sizeof(cachedChunk{})) + 32 + 8)

type chunkCache struct {
	mu       sync.Mutex
	limit    int64
	spillDir string
	// room checks that a spill file can take n more bytes
	// (source.RoomFor; a variable for tests).
	room    func(f *os.File, n int64) error
	mem     int64 // against limit: the slabs taken, chunks in memory of their own, and every chunk's record
	spill   *os.File
	spilled int64
	stored  int64 // the chunks' stored bytes, wherever they are
	chunks  map[[32]byte]*cachedChunk
	closed  bool
	// shards readers in all, begun of them in their stream; changed is
	// signalled as chunks arrive, as begun grows and when the cache closes.
	shards, begun int
	changed       *sync.Cond
	// slabs are those taken, the last one being carved (at slabUsed); the
	// filler makes the next ones (counted in mem once taken).
	slabs    [][]byte
	slabUsed int
	filler   *slabFiller
}

const (
	// slabSize is what the filler allocates at once; chunks above
	// maxSlabChunk get memory of their own.
	slabSize     = 64 << 20
	maxSlabChunk = slabSize / 8
)

func newChunkCache(limit int64, spillDir string, shards int) *chunkCache {
	k := &chunkCache{limit: limit, spillDir: spillDir, room: source.RoomFor, chunks: map[[32]byte]*cachedChunk{}, shards: shards}
	k.changed = sync.NewCond(&k.mu)
	return k
}

// alloc gives memory for a CHUNK record of n bytes: a slab's while the
// budget has room for slabs, else memory of its own (put spills it).
func (k *chunkCache) alloc(n int) []byte {
	k.mu.Lock()
	if n > maxSlabChunk || k.closed {
		k.mu.Unlock()
		return make([]byte, n)
	}
	if len(k.slabs) > 0 && k.slabUsed+n <= slabSize {
		b := k.slabs[len(k.slabs)-1][k.slabUsed : k.slabUsed+n : k.slabUsed+n]
		k.slabUsed += n
		k.mu.Unlock()
		return b
	}
	if k.mem+slabSize > k.dataLimit() {
		k.mu.Unlock()
		return make([]byte, n)
	}
	if k.filler == nil {
		k.filler = startSlabFiller()
	}
	f := k.filler
	k.mem += slabSize // reserved before the wait, so that no other reader overdraws
	k.mu.Unlock()
	slab := f.take()
	k.mu.Lock()
	defer k.mu.Unlock()
	if slab == nil || k.closed {
		return make([]byte, n)
	}
	// Another reader may have taken a slab meanwhile: carve the newer
	// one from here on, what is left of the other is not used.
	k.slabs = append(k.slabs, slab)
	k.slabUsed = n
	return slab[:n:n]
}

// dataLimit is what chunk bytes may take of the budget, with the records:
// all but the eighth kept for the records of chunks still to come.
func (k *chunkCache) dataLimit() int64 { return k.limit - k.limit/8 }

// inSlab says whether b lies in one of the slabs (the newest ones are
// those a reader has in flight).
func (k *chunkCache) inSlab(b []byte) bool {
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	for i := len(k.slabs) - 1; i >= 0; i-- {
		s := uintptr(unsafe.Pointer(unsafe.SliceData(k.slabs[i])))
		if p >= s && p < s+slabSize {
			return true
		}
	}
	return false
}

// slabFiller allocates slabs ahead of the readers, asks for huge pages
// and faults them in: at most two beyond those taken (one handed over,
// one in the making), which the budget does not count.
type slabFiller struct {
	next chan []byte
	quit chan struct{}
	done chan struct{}
}

func startSlabFiller() *slabFiller {
	f := &slabFiller{next: make(chan []byte, 1), quit: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(f.done)
		for {
			b := make([]byte, slabSize)
			// Best effort: without transparent huge pages the pages are
			// small, and faulted in here all the same.
			_ = unix.Madvise(b, unix.MADV_HUGEPAGE)
			for i := 0; i < len(b); i += 4096 {
				b[i] = 0
			}
			select {
			case f.next <- b:
			case <-f.quit:
				return
			}
		}
	}()
	return f
}

// take gives the next slab; nil once the filler is stopped.
func (f *slabFiller) take() []byte {
	select {
	case b := <-f.next:
		return b
	case <-f.quit:
		return nil
	}
}

// stop ends the filler and waits for it.
func (f *slabFiller) stop() {
	close(f.quit)
	<-f.done
}

// begin notes that one connection's reader has begun its stream.
func (k *chunkCache) begin() {
	k.mu.Lock()
	k.begun++
	k.mu.Unlock()
	k.changed.Broadcast()
}

// put keeps c (its Stored is the cache's from here).
func (k *chunkCache) put(c wire.Chunk) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.closed {
		return errors.New("chunk cache closed")
	}
	if _, ok := k.chunks[c.ID]; ok {
		return nil
	}
	if k.mem+chunkRecord > k.limit {
		return fmt.Errorf("chunk cache: the records of %d chunks, beside the chunks kept in memory, would pass the memory limit of %d bytes (--memory-limit): %w",
			len(k.chunks)+1, k.limit, source.ErrMemoryLimit)
	}
	e := &cachedChunk{codec: c.Codec, raw: c.RawLen, crc: c.CRC}
	n := int64(len(c.Stored))
	switch {
	case k.inSlab(c.Stored): // counted with its slab
		e.stored = c.Stored
	case k.mem+chunkRecord+n <= k.dataLimit():
		e.stored, k.mem = c.Stored, k.mem+n
	default:
		if k.spill == nil {
			f, err := os.CreateTemp(k.spillDir, "gpucr-chunk-cache-*")
			if err != nil {
				return fmt.Errorf("chunk cache: spill beyond %d bytes: %w", k.limit, err)
			}
			os.Remove(f.Name()) // gone with the last descriptor, whatever happens
			k.spill = f
		}
		if err := k.room(k.spill, n); err != nil {
			return fmt.Errorf("chunk cache: spill beyond %d bytes: %w", k.limit, err)
		}
		if _, err := k.spill.WriteAt(c.Stored, k.spilled); err != nil {
			return fmt.Errorf("chunk cache: spill to %s: %w", k.spill.Name(), err)
		}
		e.off, e.length = k.spilled, n
		k.spilled += n
	}
	k.chunks[c.ID] = e
	k.mem += chunkRecord
	k.stored += n
	k.changed.Broadcast()
	return nil
}

// payload gives the payload of the DATA frame a REF record's header
// stands for, once the header checks and names a chunk held here with the
// same raw length, CRC, codec and stored length. A chunk held in memory is
// given as the cache's own bytes (lendable: read only, counted by the cache's
// budget, and kept alive by the caller after close): the final dump's
// references are most of a migration's image, and copying them on the way
// cost the downtime time and memory. A spilled one is read into a buffer
// of its own, which the caller's budget must count.
func (k *chunkCache) payload(hdr []byte) (b []byte, lendable bool, err error) {
	fh, err := manifest.UnmarshalFrameHeader(hdr)
	if err != nil {
		return nil, false, fmt.Errorf("REF record: %w: %w", err, errdefs.ErrCorrupt)
	}
	if fh.Type != manifest.FrameData {
		return nil, false, fmt.Errorf("REF record for a %s frame: %w", fh.Type, errdefs.ErrCorrupt)
	}
	k.mu.Lock()
	e, ok := k.chunks[fh.Hash]
	for !ok && !k.closed && k.begun < k.shards {
		k.changed.Wait()
		e, ok = k.chunks[fh.Hash]
	}
	spill := k.spill
	k.mu.Unlock()
	switch {
	case !ok:
		return nil, false, fmt.Errorf("REF record at offset %d of file %d names chunk %x, which this receiver does not hold: %w", fh.Offset, fh.FileID, fh.Hash, errdefs.ErrCorrupt)
	case e.codec != fh.Codec || e.raw != fh.RawLen || e.crc != fh.Checksum || int64(fh.StoredLen) != max(int64(len(e.stored)), e.length):
		return nil, false, fmt.Errorf("REF record names chunk %x as %d raw bytes in codec %d (%d stored, CRC-32C %08x); the cache holds %d in codec %d (CRC-32C %08x): %w",
			fh.Hash, fh.RawLen, fh.Codec, fh.StoredLen, fh.Checksum, e.raw, e.codec, e.crc, errdefs.ErrCorrupt)
	}
	if e.stored != nil {
		return e.stored, true, nil
	}
	// Spilled: the entry and the file's bytes are never rewritten, and a
	// closed cache's file is closed, which ReadAt reports.
	b = make([]byte, e.length)
	if _, err := spill.ReadAt(b, e.off); err != nil {
		return nil, false, fmt.Errorf("chunk cache: read %s: %w", spill.Name(), err)
	}
	return b, false, nil
}

// stats are what the cache holds: chunks, and their stored bytes.
func (k *chunkCache) stats() (n int, bytes int64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.chunks), k.stored
}

// close frees the cache: memory and spill file.
func (k *chunkCache) close() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.closed = true
	k.chunks, k.mem, k.slabs = nil, 0, nil
	k.changed.Broadcast()
	if k.filler != nil {
		k.filler.stop()
		k.filler = nil
	}
	if k.spill != nil {
		k.spill.Close()
		k.spill = nil
	}
}
