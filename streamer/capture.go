package streamer

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/bufpool"
	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
)

// smallRead is the first read of every file: CRIU sends hundreds of
// small images that stay open until the end, and they must not each pin a
// full chunk of the budget.
const smallRead = 64 << 10

// chunkTokens is how many chunks may be in flight: at least enough to keep
// every worker busy while the writer holds one.
func chunkTokens(o pipeline.Options, perChunk int) int {
	n := int(o.MemoryLimit / int64(perChunk))
	if min := 2*o.Workers + 2; n < min {
		n = min
	}
	return n
}

// Capture is a running capture pipeline: producers call WriteFile
// concurrently, one call per file; Close commits.
type Capture struct {
	opts   pipeline.Options
	enc    *codec.Encoder
	out    Output
	ctx    context.Context
	cancel context.CancelCauseFunc
	order  chan *item // every item, in submission order, for the writer
	jobs   chan *item // DATA items, for the workers
	tokens chan struct{}
	gate   gate           // the tokens' order for background files (background.go)
	bufs   *bufpool.Pool  // raw and encoded chunks alike
	encDst bool           // the codec writes into a buffer of its own
	seal   *crypt.Session // the output's, when it is encrypted
	// shared: chunks are sealed for a chunk store (Format.Shared).
	shared bool
	sums   pipeline.Digester
	// knows, for an output that deduplicates, says its destination holds
	// a chunk already: such a chunk is not encoded, and files are cut by
	// content (cdc.go).
	knows func(id [32]byte) bool
	// peerHas says the tee's primary's peer has a chunk already: it goes
	// raw (codec none), not encoded, as the primary sends it by reference
	// and its copy needs only the bytes.
	peerHas func(id [32]byte) bool

	mu     sync.Mutex
	nextID uint32

	workers    sync.WaitGroup
	writerDone chan struct{}
	started    time.Time
	Counters   pipeline.Counters

	// owned by the writer goroutine until writerDone closes
	man       manifest.Manifest
	files     map[uint32]*fileState
	committed map[string]committedFile
	late      lateFrames // Options.LateData (late.go)
}

type committedFile struct {
	manifest.File
	id uint32
}

type item struct {
	done   chan struct{} // a DATA item's: closed once encoded
	kind   manifest.FrameType
	fileID uint32
	name   string
	flags  uint16
	off    int64
	raw    []byte // nil once encoded: only rawLen is left
	rawLen int
	rawBuf []byte // pooled backing of raw, or nil
	token  bool
	// background: its token is a background chunk's (background.go)
	background bool
	encBuf     []byte // pooled backing of stored, or nil
	stored     []byte
	codec      codec.ID
	crc        uint32
	sums       chunkSums // what the producer learned of raw while reading it
	hash       [32]byte
	size       int64
	chunks     uint32
	// A chunk of WriteCuts: known, held by the output (not read, not
	// encoded); visit sees the raw bytes on a worker, and visited counts
	// it done (cuts.go).
	known   bool
	visit   func([]byte)
	visited *sync.WaitGroup
	// lent: raw is a Lender's memory, and this counts the item's release
	// (lend.go).
	lent *sync.WaitGroup
}

type fileState struct {
	file     manifest.File
	digested []byte // what its digest covers of each chunk written (Digester.Chunk)
	late     bool   // its non-zero chunks are written late (late.go)
}

// NewCapture starts the workers and the ordered writer. The pipeline stops
// at the first error; ctx cancels it.
func NewCapture(ctx context.Context, out Output, opts pipeline.Options) (*Capture, error) {
	opts = opts.WithDefaults()
	enc, err := codec.NewEncoder(opts.Codec)
	if err != nil {
		return nil, err
	}
	if err := checkTee(out); err != nil {
		return nil, err
	}
	format := FormatOf(out)
	if opts.LateData && !format.LateData {
		return nil, errors.New("capture: page images last needs a stream written as format 5 (pipeline.Format.LateData)")
	}
	seal := format.Seal
	ctx, cancel := context.WithCancelCause(ctx)
	encMax := enc.MaxEncodedLen(opts.ChunkSize)
	bufSize := max(opts.ChunkSize, encMax)
	if seal != nil {
		bufSize += crypt.PackOverhead // sealed in place, or after a salt
	}
	tokens := chunkTokens(opts, opts.ChunkSize+encMax)
	// window: the items (so chunk buffers) that may wait between the
	// producers and the writer, whatever order the workers finish in.
	window := 4 * opts.Workers
	// bufs: one size for raw and encoded chunks, so that a buffer freed by
	// one serves the other; a chunk holds two only while it is encoded.
	c := &Capture{
		opts:       opts,
		enc:        enc,
		out:        out,
		ctx:        ctx,
		cancel:     cancel,
		order:      make(chan *item, window),
		jobs:       make(chan *item, window+1), // never full: see submit
		tokens:     make(chan struct{}, tokens),
		bufs:       bufpool.New(bufSize, 2*tokens),
		encDst:     encMax > 0,
		seal:       seal,
		shared:     format.Shared && seal != nil,
		sums:       format.Digester(),
		knows:      knowerOf(out),
		peerHas:    peerHasOf(out),
		writerDone: make(chan struct{}),
		started:    time.Now(),
		files:      map[uint32]*fileState{},
		committed:  map[string]committedFile{},
	}
	// A chunk the workers encode or seal spends its time on one: there the
	// bound of one background chunk per worker starved them (background.go).
	perWorker := opts.Workers
	if encMax > 0 || seal != nil {
		perWorker = tokens
	}
	c.gate.init(ctx, tokens, window, perWorker)
	c.workers.Add(opts.Workers)
	for range opts.Workers {
		go c.encodeLoop()
	}
	go c.writeLoop()
	return c, nil
}

// errClosed is the cause recorded when Close finishes normally.
var errClosed = errors.New("capture closed")

// Err is the cause that stopped the pipeline, or nil (also after a
// successful Close).
func (c *Capture) Err() error {
	if c.ctx.Err() == nil {
		return nil
	}
	if err := context.Cause(c.ctx); !errors.Is(err, errClosed) {
		return err
	}
	return nil
}

// Done is closed when the pipeline has stopped: with an error, canceled,
// or closed.
func (c *Capture) Done() <-chan struct{} { return c.ctx.Done() }

func (c *Capture) fail(err error) { c.cancel(err) }

func (c *Capture) submit(it *item) error {
	// select picks at random among ready cases: check for a stop first, or
	// a failed pipeline could still accept (and then drop) data.
	if c.ctx.Err() != nil {
		c.release(it)
		return context.Cause(c.ctx)
	}
	if it.kind == manifest.FrameData {
		it.done = make(chan struct{})
	}
	select {
	case c.order <- it:
	case <-c.ctx.Done():
		c.release(it)
		return context.Cause(c.ctx)
	}
	if it.done != nil {
		// jobs holds only items that order let through and the writer has
		// not released: it always has room.
		c.jobs <- it
	}
	return nil
}

// chunkBuf gives it a budgeted buffer (its token and rawBuf, which
// release gives back) and returns it at the chunk size.
func (c *Capture) chunkBuf(it *item, background bool) ([]byte, error) {
	if err := c.acquire(background); err != nil {
		return nil, err
	}
	it.token, it.background = true, background
	it.rawBuf = c.bufs.Get()
	return it.rawBuf[:c.opts.ChunkSize], nil
}

func (c *Capture) release(it *item) {
	it.visitDone()
	if it.lent != nil {
		it.lent.Done()
		it.lent = nil
	}
	c.bufs.Put(it.rawBuf)
	c.bufs.Put(it.encBuf)
	it.rawBuf, it.encBuf = nil, nil
	if it.token {
		c.releaseToken(it.background)
		it.token = false
	}
	it.raw, it.stored = nil, nil
}

// WriteFile reads one file to its end and feeds it to the pipeline. Files
// may be written concurrently; a name written again replaces the earlier
// file. It returns the number of bytes read.
func (c *Capture) WriteFile(name string, r io.Reader, external bool) (int64, error) {
	var flags uint16
	if external {
		flags = manifest.FileFlagExternal
	}
	return c.writeFile(name, r, flags, false)
}

// WriteCarried is WriteFile of a file the caller put into CRIU's images
// dir, which a restore writes back there (manifest.FileFlagCarried).
func (c *Capture) WriteCarried(name string, r io.Reader) (int64, error) {
	return c.writeFile(name, r, manifest.FileFlagExternal|manifest.FileFlagCarried, false)
}

// openFile gives the file name its id and submits its FILE frame.
func (c *Capture) openFile(name string, flags uint16) (uint32, error) {
	if !manifest.ValidName(name) {
		return 0, fmt.Errorf("capture: invalid file name %q (one path component, no NUL, at most %d bytes)", name, manifest.MaxNameLen)
	}
	c.mu.Lock()
	id := c.nextID
	c.nextID++
	c.mu.Unlock()
	return id, c.submit(&item{kind: manifest.FrameFile, fileID: id, name: name, flags: flags})
}

func (c *Capture) writeFile(name string, r io.Reader, flags uint16, background bool) (int64, error) {
	id, err := c.openFile(name, flags)
	if err != nil {
		return 0, err
	}
	if l, ok := c.lends(r); ok {
		return c.writeLent(id, name, l, background)
	}
	var off int64
	var chunks uint32
	first := true
	var cut *cutter // content-defined boundaries, once the file is not small
	for {
		it := &item{kind: manifest.FrameData, fileID: id, name: name, off: off}
		var buf []byte
		var n int
		var err error
		small := min(smallRead, c.opts.ChunkSize)
		switch {
		case first:
			buf = make([]byte, small)
			n, err = it.sums.fill(r, buf)
		case cut != nil:
			if buf, err = c.chunkBuf(it, background); err != nil {
				return off, err
			}
			n, err = cut.next(buf, &it.sums)
		default:
			if buf, err = c.chunkBuf(it, background); err != nil {
				return off, err
			}
			n, err = it.sums.fill(r, buf)
		}
		if first && n == small && small < c.opts.ChunkSize && err == nil {
			if c.knows != nil {
				// Not small: cut it by content, from its first byte.
				cut = newCutter(r, c.opts.ChunkSize, buf)
				first = false
				continue
			}
			// Not small after all: move what we have into a budgeted chunk.
			var big []byte
			if big, err = c.chunkBuf(it, background); err != nil {
				return off, err
			}
			copy(big, buf)
			var m int
			m, err = it.sums.fill(r, big[small:])
			n, buf = small+m, big
		}
		first = false
		eof := errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
		if err != nil && !eof {
			c.release(it)
			return off, fmt.Errorf("read %s at offset %d: %w", name, off+int64(n), err)
		}
		if n > 0 {
			it.raw, it.rawLen = buf[:n], n
			if err := c.submit(it); err != nil {
				return off, err
			}
			off += int64(n)
			chunks++
			c.Counters.RawBytes.Add(int64(n))
		} else {
			c.release(it)
		}
		if eof {
			break
		}
	}
	if err := c.submit(&item{kind: manifest.FrameFileEnd, fileID: id, name: name, size: off, chunks: chunks}); err != nil {
		return off, err
	}
	return off, nil
}

func (c *Capture) encodeLoop() {
	defer c.workers.Done()
	for it := range c.jobs {
		if c.ctx.Err() == nil {
			if err := c.encode(it); err != nil {
				c.fail(err)
			}
		}
		it.visitDone()
		close(it.done)
	}
}

func (c *Capture) encode(it *item) error {
	if it.known {
		return nil // codec none, nothing stored: the output references it
	}
	if it.visit != nil {
		it.visit(it.raw)
	}
	if c.seal != nil {
		return c.sealChunk(it)
	}
	if it.sums.zero {
		it.codec, it.stored = codec.Zero, nil
		it.crc, it.hash = c.sums.Zero(len(it.raw))
		c.dropRaw(it)
		return nil
	}
	it.crc = it.sums.crc
	it.hash = c.sums.Content(it.raw)
	if c.knows != nil && c.knows(it.hash) {
		// Stored already: the output references it (FramePos.Ref).
		it.codec, it.stored = codec.None, nil
		c.dropRaw(it)
		return nil
	}
	if c.peerHas != nil && c.peerHas(it.hash) {
		it.codec, it.stored = codec.None, it.raw
		return nil
	}
	id, stored, err := c.encodeRaw(it)
	if err != nil {
		return err
	}
	it.codec, it.stored = id, stored
	// Of raw and encoded, keep only the buffer that stored is in: chunks
	// waiting for the writer then hold one buffer each, not two.
	if len(stored) > 0 && &stored[0] == &it.raw[0] {
		c.bufs.Put(it.encBuf)
		it.encBuf = nil
	} else {
		c.dropRaw(it)
	}
	return nil
}

// encodeRaw runs the codec over the chunk's raw bytes, into a pooled
// buffer (it.encBuf) where the codec wants one; the caller keeps or drops
// the buffers.
func (c *Capture) encodeRaw(it *item) (codec.ID, []byte, error) {
	var dst []byte
	if c.encDst {
		it.encBuf = c.bufs.Get()
		dst = it.encBuf[:0]
	}
	id, stored, err := c.enc.Encode(dst, it.raw)
	if err != nil {
		return 0, nil, fmt.Errorf("encode chunk at offset %d: %w", it.off, err)
	}
	return id, stored, nil
}

// chunkSums is what the producer computes of a chunk as it reads it: each
// piece a read returns is still in the cache then, while the worker that
// gets the chunk would read it back from memory (a 4 MiB chunk does not
// stay in L2, and comes from another core). The zero test and CRC-32C are
// cheap enough (tens of GB/s in cache) not to slow the producer; BLAKE3
// is not, and stays on the workers.
type chunkSums struct {
	n    int    // bytes summed
	zero bool   // every byte so far is zero (the CRC waits until one is not)
	crc  uint32 // CRC-32C of the n bytes, unless zero
}

// fill reads into buf until it is full or r ends, as io.ReadFull does, and
// sums what it reads; it continues where an earlier fill of the same chunk
// stopped (buf is then the rest of the chunk).
func (s *chunkSums) fill(r io.Reader, buf []byte) (int, error) {
	if s.n == 0 {
		s.zero = true
	}
	n := 0
	for n < len(buf) {
		k, err := r.Read(buf[n:])
		s.add(buf[n : n+k])
		n += k
		if err != nil {
			if errors.Is(err, io.EOF) && n > 0 {
				err = io.ErrUnexpectedEOF
			}
			return n, err
		}
	}
	return n, nil
}

func (s *chunkSums) add(b []byte) {
	if len(b) == 0 {
		return
	}
	if s.zero {
		if codec.IsZero(b) {
			s.n += len(b)
			return
		}
		s.zero = false
		s.crc = zerosCRC(s.n) // the zeros so far count too
	}
	s.crc = codec.UpdateChecksum(s.crc, b)
	s.n += len(b)
}

// addPage adds one page (cdcPage bytes) whose zero test and CRC-32C the
// cutter has made: the chunk's CRC-32C is joined from its pages', without
// a second pass over them.
func (s *chunkSums) addPage(zero bool, crc uint32) {
	if s.zero {
		if zero {
			s.n += cdcPage
			return
		}
		s.zero = false
		s.crc = zerosCRC(s.n)
	}
	s.crc = pageCRCs.Combine(s.crc, crc)
	s.n += cdcPage
}

// zerosCRC is the CRC-32C of n zero bytes, joined from the zero page's.
func zerosCRC(n int) uint32 {
	var crc uint32
	for ; n >= cdcPage; n -= cdcPage {
		crc = pageCRCs.Combine(crc, zeroPageCRC)
	}
	return codec.UpdateChecksum(crc, zeroPage[:n])
}

// dropRaw gives an encoded chunk's raw buffer back.
func (c *Capture) dropRaw(it *item) {
	c.bufs.Put(it.rawBuf)
	it.raw, it.rawBuf = nil, nil
}

// writeLoop writes the items in submission order, each once it is
// encoded. Waiting for the oldest keeps the later ones in the order queue,
// so a chunk that is slow to encode holds back the producers: it cannot
// let the others pile up. An item whose payload an AsyncOutput took is
// released when its write ends, so its buffer and token stay held until
// then, and memory stays bounded by the tokens.
func (c *Capture) writeLoop() {
	defer close(c.writerDone)
	for it := range c.order {
		if it.done != nil {
			<-it.done
		}
		if c.ctx.Err() == nil {
			taken, err := c.write(it)
			if err != nil {
				c.fail(err)
			}
			if taken {
				continue
			}
		}
		c.release(it)
	}
}

// write writes one item; taken says the output took the item's payload
// and will release the item itself.
func (c *Capture) write(it *item) (taken bool, err error) {
	ctx := c.ctx
	switch it.kind {
	case manifest.FrameFile:
		fh := manifest.FrameHeader{Type: manifest.FrameFile, FileID: it.fileID, Flags: it.flags, RawLen: uint32(len(it.name))}
		if _, err := c.out.WriteFrame(ctx, &fh, []byte(it.name)); err != nil {
			return false, fmt.Errorf("write %s: %w", it.name, err)
		}
		c.files[it.fileID] = &fileState{file: manifest.File{Name: it.name, External: it.flags&manifest.FileFlagExternal != 0,
			Carried: it.flags&manifest.FileFlagCarried != 0, Chunks: []manifest.Chunk{}},
			late: c.opts.LateData && pagesImage.MatchString(it.name)}
		if c.seal != nil {
			c.files[it.fileID].file.ID = it.fileID // sealed chunks are bound to it
		}
	case manifest.FrameData:
		fs := c.files[it.fileID]
		stored := len(it.stored)
		fh := manifest.FrameHeader{Type: manifest.FrameData, Codec: uint8(it.codec), FileID: it.fileID, Offset: uint64(it.off),
			RawLen: uint32(it.rawLen), StoredLen: uint32(stored), Checksum: it.crc, Hash: it.hash}
		var loc FramePos
		if fs.late && it.codec != codec.Zero {
			err = c.addLate(fs, fh, it.stored, len(fs.file.Chunks))
		} else if ao, ok := c.out.(AsyncOutput); ok {
			// From here the item is the output's until done: read nothing
			// of its buffers.
			name, off := fs.file.Name, it.off
			loc, err = ao.WriteFrameAsync(ctx, &fh, it.stored, func(err error) {
				if err != nil {
					c.fail(fmt.Errorf("write %s at offset %d: %w", name, off, err))
				}
				c.release(it)
			})
			taken = err == nil
		} else {
			loc, err = c.out.WriteFrame(ctx, &fh, it.stored)
		}
		if err != nil {
			return false, fmt.Errorf("write %s at offset %d: %w", fs.file.Name, it.off, err)
		}
		if loc.Ref {
			fh.StoredLen, fh.Codec, stored = loc.Stored, loc.Codec, int(loc.Stored)
		}
		fs.file.Chunks = append(fs.file.Chunks, manifest.Chunk{Offset: it.off, RawLen: fh.RawLen, Stored: fh.StoredLen,
			Codec: fh.Codec, Checksum: it.crc, Hash: it.hash, Segment: loc.Segment, Pos: loc.Pos})
		fs.digested = c.sums.Chunk(fs.digested, it.crc, fh.RawLen, it.hash)
		c.man.Stats.Add(codec.ID(fh.Codec).String(), int64(it.rawLen), int64(stored))
		c.Counters.StoredBytes.Add(int64(stored))
		c.Counters.StoredRaw.Add(int64(it.rawLen))
	case manifest.FrameFileEnd:
		fs := c.files[it.fileID]
		delete(c.files, it.fileID)
		fs.file.Size = it.size
		fs.file.Digest = c.sums.Digest(fs.digested, it.size)
		fh := manifest.FrameHeader{Type: manifest.FrameFileEnd, FileID: it.fileID, Offset: uint64(it.size), RawLen: it.chunks, Hash: fs.file.Digest}
		if _, err := c.out.WriteFrame(ctx, &fh, nil); err != nil {
			return false, fmt.Errorf("finish %s: %w", fs.file.Name, err)
		}
		// A name written twice: the later open wins, whichever ends last.
		if old, ok := c.committed[fs.file.Name]; !ok || old.id < it.fileID {
			c.committed[fs.file.Name] = committedFile{File: fs.file, id: it.fileID}
		}
		c.Counters.Files.Add(1)
	}
	return taken, nil
}

// Close waits for every written file to pass through the pipeline, then
// commits the output with the manifest built from what was written. Call it
// after every WriteFile has returned. On any earlier error it aborts the
// output and returns that error.
func (c *Capture) Close(ctx context.Context, meta manifest.Manifest) (*manifest.Manifest, error) {
	close(c.jobs)
	close(c.order)
	c.workers.Wait()
	<-c.writerDone
	defer c.closeLate()
	if err := c.Err(); err != nil {
		_ = c.out.Abort(ctx)
		return nil, err
	}
	defer c.cancel(errClosed)
	if len(c.files) > 0 {
		_ = c.out.Abort(ctx)
		return nil, errors.New("capture: files still open at close")
	}
	if err := c.writeLate(c.ctx); err != nil {
		_ = c.out.Abort(ctx)
		return nil, err
	}
	m := meta
	m.Encryption = pipeline.EncryptionOf(c.seal)
	m.NoChunkHashes = c.sums.NoChunkHashes
	m.Format = m.FormatVersion()
	m.ChunkSize = c.opts.ChunkSize
	m.Codec = c.opts.Codec.String()
	m.Stats = c.man.Stats
	if m.Created.IsZero() {
		m.Created = time.Now().UTC()
	}
	if m.Host == "" {
		m.Host, _ = os.Hostname()
	}
	if m.ID == "" {
		m.ID = newID()
	}
	m.Files = make([]manifest.File, 0, len(c.committed))
	for _, f := range c.committed {
		m.Files = append(m.Files, f.File)
	}
	sort.Slice(m.Files, func(i, j int) bool { return m.Files[i].Name < m.Files[j].Name })
	// Stats count every chunk written, also of files later replaced; recount
	// so that the manifest describes what it indexes.
	m.Stats = manifest.Stats{}
	for _, f := range m.Files {
		for _, ch := range f.Chunks {
			m.Stats.Add(codec.ID(ch.Codec).String(), int64(ch.RawLen), int64(ch.Stored))
		}
	}
	if err := c.out.Commit(ctx, &m); err != nil {
		_ = c.out.Abort(ctx)
		return nil, fmt.Errorf("commit: %w", err)
	}
	return &m, nil
}

// Abort stops the pipeline with err and discards the output.
func (c *Capture) Abort(err error) { c.fail(err) }

// newID is a checkpoint id: 128 random bits in hex.
func newID() string {
	var b [16]byte
	crand.Read(b[:])
	return hex.EncodeToString(b[:])
}
