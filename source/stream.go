package source

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"sort"
	"sync"
	"unsafe"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
)

// StreamSource decodes a live stream (stdin, shards, a socket) and holds
// each file until it is asked for: in memory up to the budget, then spilled
// to a temporary file. A file is served only once all its chunks arrived,
// passed their checksums, and matched the digest in its FILE-END frame, so
// nothing unverified ever reaches the consumer. With ExtractDir set it
// writes every file into that directory instead.
//
// By concern: this file keeps the files and what they cost;
// stream_decode.go reads the shards and decodes their frames;
// stream_spill.go, stream_extract.go and stream_early.go hold the state of
// spilling, of an extract and of serving early; stream_serve.go serves.
// One mutex, mu, guards the files, the counts and the state of every mode.
type StreamSource struct {
	opts    pipeline.Options
	discard bool // Discard: check everything, keep nothing
	// extract writes every file into a directory (ExtractDir); nil when
	// the stream is served.
	extract *extraction
	// early serves files as they arrive (ServeEarly); nil when off.
	early *earlyServe

	mu       sync.Mutex
	changed  chan struct{} // closed and replaced on every change
	pending  map[uint32]*streamFile
	doneIDs  map[uint32]bool
	complete map[string]*streamFile
	ended    bool
	err      error
	closed   bool // Close ran
	shards   int
	// shardBytes is each shard's stream bytes read, known once it ended.
	shardBytes []int64
	// memUsed counts the chunks kept in memory (chunkRec.memCost).
	memUsed int64
	// metaUsed counts what the stream's metadata holds (files, names,
	// chunk records): it shares the budget with the data, and a stream
	// whose metadata alone exceeds it is refused.
	metaUsed int64
	chunks   int64
	// retired holds the files replaced by a later copy while a Copy still
	// reads them: their memory stays counted until the last Copy of them
	// ends (copyEnd) or Close, and is freed then.
	retired map[*streamFile]bool
	// spill holds the chunks beyond the budget.
	spill spillFiles

	// inflight counts the DATA frames not yet stored: a quarter of the
	// budget, which chunks kept in memory leave to it.
	inflight *inflight
	// pages: large payloads are read into page buffers from here. A raw
	// (codec none) payload stays where it was read and becomes the chunk;
	// a compressed one is decoded into another and goes back.
	pages pagePool
	// seal opens the chunks of an encrypted stream; set (with sums) by the
	// first shard's reader before any chunk is decoded.
	seal *crypt.Session
	sums pipeline.Digester

	wg     sync.WaitGroup
	cancel context.CancelFunc
	pipeline.Counters
}

type streamFile struct {
	id       uint32
	name     string
	external bool
	carried  bool
	size     int64 // -1 until FILE-END
	expect   uint32
	digest   [32]byte
	chunks   []chunkRec
	fd       *os.File // extract mode: the file being written
	tmpPath  string
	meta     int64 // what metaUsed counts for this file
	// copies counts the Copy calls reading its chunks: a replaced file's
	// memory is freed once none is (releaseLocked).
	copies int
	// ahead counts its DATA frames read before its end was known, aheadIn
	// those of them decoded (stream_early.go).
	ahead, aheadIn int
}

type chunkRec struct {
	off  int64
	n    int64
	crc  uint32
	hash [32]byte
	zero bool
	mem  []byte
	page *pageBuf // mem's mapping, when mem may be spliced (trimmed to it)
	// borrowed: mem is the reader's memory (manifest.Frame.Borrowed, a chunk
	// cache's), not counted here and never written by anyone: it may be
	// spliced too. The slice keeps it from Go's heap until Close, and the
	// pipes it went to are read by then (CRIU and the GPU copy in have
	// finished with them when a restore is done).
	borrowed bool
	fd       *os.File // where a spilled or extracted chunk lives
	foff     int64
}

// ErrMemoryLimit means what a stream holds would exceed Options.MemoryLimit
// where it cannot spill.
var ErrMemoryLimit = errors.New("memory limit reached")

// StreamSourceOptions configures a StreamSource.
type StreamSourceOptions struct {
	pipeline.Options
	// ExtractDir, when set, receives every file: each written as it
	// arrives under a temporary name, all renamed into place once the
	// whole stream is in and checked.
	ExtractDir string
	// SpillDir holds spilled chunks; empty means os.TempDir().
	SpillDir string
	// Discard checks everything but keeps no data (verify, inspect).
	Discard bool
	// ServeEarly serves each file as soon as it is complete and checked,
	// and a file whose FILE-END came ahead of its data as its chunks arrive
	// (Copy). Off, nothing is served until the whole stream has been read and checked
	// (END frame included): CRIU's dump sends inventory.img last and restore
	// asks for it first, so waiting costs nothing there and means a stream
	// damaged anywhere never starts a restore.
	ServeEarly bool
	// Log takes a line for each file copied as it arrives.
	Log func(string)
}

// NewStreamSource starts decoding the shards (one reader each) in the
// background. names label the shards in errors.
func NewStreamSource(ctx context.Context, shards []io.Reader, names []string, so StreamSourceOptions) *StreamSource {
	ctx, cancel := context.WithCancel(ctx)
	s := &StreamSource{
		opts:       so.Options.WithDefaults(),
		discard:    so.Discard,
		changed:    make(chan struct{}),
		pending:    map[uint32]*streamFile{},
		doneIDs:    map[uint32]bool{},
		complete:   map[string]*streamFile{},
		retired:    map[*streamFile]bool{},
		cancel:     cancel,
		shardBytes: make([]int64, len(shards)),
		shards:     len(shards),
		spill:      spillFiles{dir: so.SpillDir, max: max(1, min(runtime.GOMAXPROCS(0), maxSpillFiles))},
	}
	if so.ExtractDir != "" {
		s.extract = &extraction{dir: so.ExtractDir, maxSpare: maxSpare(s.opts.Workers, len(shards))}
	}
	if so.ServeEarly {
		s.early = &earlyServe{log: so.Log}
	}
	s.inflight = newInflight(s.opts.MemoryLimit / 4)
	s.pages = pagePool{size: pipeline.DefaultChunkSize, keep: 2*s.opts.Workers + 2}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		err := s.run(ctx, shards, names)
		s.mu.Lock()
		defer s.mu.Unlock()
		s.endLocked(err)
	}()
	return s
}

// endLocked ends the stream with the error of its run (nil: read to its
// END frame): every file must be complete, and an extract is published or
// undone.
func (s *StreamSource) endLocked(err error) {
	if err == nil && len(s.pending) > 0 {
		for _, f := range s.pending {
			err = fmt.Errorf("stream ended but file %s is incomplete (%d chunks received)", manifest.PrintableName(f.name), len(f.chunks))
			break
		}
	}
	if err != nil && s.err == nil {
		s.err = err
	}
	if x := s.extract; x != nil {
		if s.err == nil {
			s.err = x.publish(s.complete)
		}
		x.dropSpare()
		if s.err != nil {
			// A failed extract leaves nothing behind, not even the files
			// it finished: the image is incomplete.
			x.undo()
		}
	}
	s.ended = true
	s.notifyLocked()
}

func (s *StreamSource) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// inMemory says chunks may be kept in memory to be served: the stream is
// neither discarded nor extracted. Only then are they read into page
// buffers, which Copy may splice.
func (s *StreamSource) inMemory() bool { return !s.discard && s.extract == nil }

// What the metadata of one file and one chunk hold, counted generously:
// the file record, its name twice (here and in the frame reader, until
// its FILE-END) and map entries; a chunk record and the slack of a growing
// slice; a completed file's entry in doneIDs, kept when it is replaced.
const (
	fileMeta  = 256
	doneMeta  = 48
	chunkMeta = 2 * int64(unsafe.Sizeof(chunkRec{}))
)

// addMetaLocked counts n more bytes of metadata against the budget.
// A nil f counts what outlives any file.
func (s *StreamSource) addMetaLocked(f *streamFile, n int64) error {
	if f != nil {
		f.meta += n
	}
	s.metaUsed += n
	if s.metaUsed > s.opts.MemoryLimit {
		return fmt.Errorf("stream metadata (%d files, %d chunks: %d bytes) exceeds the memory limit of %d bytes (--memory-limit): %w",
			len(s.pending)+len(s.complete), s.chunks, s.metaUsed, s.opts.MemoryLimit, ErrMemoryLimit)
	}
	return nil
}

// maybeCompleteLocked publishes f once all its chunks are in and they tile
// the file and match its digest.
func (s *StreamSource) maybeCompleteLocked(f *streamFile, where func() error) error {
	if f.size < 0 || uint32(len(f.chunks)) < f.expect {
		return nil
	}
	sort.Slice(f.chunks, func(i, j int) bool { return f.chunks[i].off < f.chunks[j].off })
	var next int64
	digested := make([]byte, 0, 32*len(f.chunks))
	for _, c := range f.chunks {
		if c.off != next {
			return fmt.Errorf("%w: %s: chunk at offset %d, expected %d", where(), manifest.PrintableName(f.name), c.off, next)
		}
		next += c.n
		digested = s.sums.Chunk(digested, c.crc, uint32(c.n), c.hash)
	}
	if next != f.size || uint32(len(f.chunks)) != f.expect {
		return fmt.Errorf("%w: %s: chunks hold %d bytes in %d chunks, FILE-END says %d in %d", where(), manifest.PrintableName(f.name), next, len(f.chunks), f.size, f.expect)
	}
	if s.sums.Digest(digested, f.size) != f.digest {
		return fmt.Errorf("%w: %s: file digest mismatch", where(), manifest.PrintableName(f.name))
	}
	delete(s.pending, f.id)
	s.doneIDs[f.id] = true
	// The id stays (a lagging shard may announce it again): counted, so
	// that a stream of files replacing each other stays in the budget.
	if err := s.addMetaLocked(nil, doneMeta); err != nil {
		return err
	}
	s.Counters.Files.Add(1)
	defer s.notifyLocked()
	// A name written twice: the later open (higher id) wins, whichever
	// completes last.
	old, hasOld := s.complete[f.name]
	if hasOld && old.id > f.id {
		s.replacedLocked(f)
		return nil
	}
	if f.fd != nil {
		// A trailing zero chunk is never written: set the length explicitly.
		if err := f.fd.Truncate(f.size); err != nil {
			return fmt.Errorf("extract %s: %w", manifest.PrintableName(f.name), err)
		}
	}
	if hasOld {
		s.replacedLocked(old)
	}
	s.complete[f.name] = f
	return nil
}

// replacedLocked releases f, replaced by a later copy. An extract keeps
// its temporary file for the next file (extraction.keep), unless a Copy of
// a file served early may read it still.
func (s *StreamSource) replacedLocked(f *streamFile) {
	if f.fd != nil && s.early == nil && f.copies == 0 {
		s.extract.keep(f)
	}
	s.dropLocked(f)
}

// dropLocked releases f and removes its temporary file in extract mode.
func (s *StreamSource) dropLocked(f *streamFile) {
	if f.tmpPath != "" {
		os.Remove(f.tmpPath)
		f.tmpPath = ""
	}
	s.releaseLocked(f)
}

// releaseLocked drops f (replaced, or at Close): its memory is freed at
// once, or, while a Copy still reads it, stays counted until the last one
// ends (copyEnd). Kept until Close, a stream re-sending one file kept every
// copy of it (3 GB for 1,500 copies of 1 MiB under a 64 MiB limit).
func (s *StreamSource) releaseLocked(f *streamFile) {
	s.metaUsed -= f.meta
	f.meta = 0
	if f.fd != nil {
		f.fd.Close()
		f.fd = nil
	}
	if f.copies > 0 {
		s.retired[f] = true
		return
	}
	s.freeLocked(f)
}

// freeLocked frees the memory of f's chunks and stops counting it. A page
// handed to a pipe by vmsplice stays alive through the pipe's reference.
// It runs once for each file: a Copy's own view of f.chunks is not
// written.
func (s *StreamSource) freeLocked(f *streamFile) {
	for _, c := range f.chunks {
		s.memUsed -= c.memCost()
		if c.page != nil {
			c.page.free()
		}
	}
	delete(s.retired, f)
}

// copyEnd ends a Copy of f (file with copying): the last one of a
// released file frees it.
func (s *StreamSource) copyEnd(f *streamFile) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f.copies--
	if f.copies == 0 && s.retired[f] {
		s.freeLocked(f)
	}
}

// memCost is what a chunk's raw bytes in mem take of the budget: a page
// buffer's huge pages (trimmed to them when the chunk is kept), or the
// bytes themselves.
func memCost(mem []byte, page *pageBuf) int64 {
	if page != nil {
		return int64(roundHuge(len(mem)))
	}
	return int64(len(mem))
}

// memCost is what c counts against the budget: nothing for memory the
// reader lends (borrowed).
func (c *chunkRec) memCost() int64 {
	if c.borrowed {
		return 0
	}
	return memCost(c.mem, c.page)
}

// putPage gives back a payload page buffer (nil is ignored).
func (s *StreamSource) putPage(p *pageBuf) {
	if p != nil {
		s.pages.put(p)
	}
}

func (s *StreamSource) wait(ctx context.Context, ready func() bool) error {
	for {
		s.mu.Lock()
		if s.err != nil {
			err := s.err
			s.mu.Unlock()
			return err
		}
		if ready() {
			s.mu.Unlock()
			return nil
		}
		ch := s.changed
		s.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Wait blocks until the whole stream has been read and checked.
func (s *StreamSource) Wait(ctx context.Context) error {
	return s.wait(ctx, func() bool { return s.ended })
}

// ShardBytes returns the stream bytes read from each shard (headers and
// frames, as they came): complete once Wait returned nil.
func (s *StreamSource) ShardBytes() []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]int64(nil), s.shardBytes...)
}

// Err returns the error that stopped the stream, if any.
func (s *StreamSource) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// Close stops decoding and removes temporary files.
func (s *StreamSource) Close() error {
	s.cancel()
	s.wg.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	// Once: a second release would free the page buffers again, and the
	// addresses may belong to new mappings by then.
	if s.closed {
		return nil
	}
	s.closed = true
	// Temporary files left are those of a stream that failed.
	for _, f := range s.complete {
		s.dropLocked(f)
	}
	for _, f := range s.pending {
		s.dropLocked(f)
	}
	if s.extract != nil {
		s.extract.dropSpare()
	}
	s.metaUsed -= doneMeta * int64(len(s.doneIDs))
	for f := range s.retired {
		s.freeLocked(f) // Close comes after every Copy
	}
	s.pages.close()
	s.spill.close()
	return nil
}
