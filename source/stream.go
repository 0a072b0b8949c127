package source

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
)

// StreamSource decodes a live stream (stdin, shards, a socket) and holds
// each file until it is asked for: in memory up to the budget, then spilled
// to a temporary file. A file is served only once all its chunks arrived,
// passed their checksums, and matched the digest in its FILE-END frame, so
// nothing unverified ever reaches the consumer. With ExtractDir set it
// writes every file into that directory instead.
type StreamSource struct {
	opts       pipeline.Options
	extractDir string
	spillDir   string
	discard    bool
	early      bool
	log        func(string)

	mu       sync.Mutex
	changed  chan struct{} // closed and replaced on every change
	pending  map[uint32]*streamFile
	doneIDs  map[uint32]bool
	complete map[string]*streamFile
	ended    bool
	// lateShards counts the shards that carried late data (Frame.Late):
	// once all have, every file of the stream has been announced, and a
	// name not among them never comes.
	lateShards, shards int
	err                error
	memUsed            int64
	// inflight counts the DATA frames not yet stored: a quarter of the
	// budget, which chunks kept in memory leave to it.
	inflight *inflight
	// metaUsed counts what the stream's metadata holds (files, names,
	// chunk records): it shares the budget with the data, and a stream
	// whose metadata alone exceeds it is refused.
	metaUsed int64
	chunks   int64
	// spills hold the chunks beyond the budget: up to spillMax unlinked
	// files, created as spilling reaches them (spillAtLocked).
	spills    []spillFile
	spillNext int // round-robin counter: the next chunk's file is spillNext % spillMax
	// spillMax is min(GOMAXPROCS, maxSpillFiles): more files than writes
	// that can run at once buy nothing.
	spillMax int
	closed   bool // Close ran
	// extracted are the files renamed into extractDir so far: once the
	// whole stream is in (publishLocked).
	extracted []string
	// spare are temporary files of extractDir emptied for the next file
	// (replacedLocked).
	spare []spareFile
	// shardBytes is each shard\'s stream bytes read, known once it ended.
	shardBytes []int64
	// retired holds the files replaced by a later copy while a Copy still
	// reads them: their memory stays counted until the last Copy of them
	// ends (copyEnd) or Close, and is freed then.
	retired map[*streamFile]bool
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

// spillFile is one file a stream spills into: append-only, so a chunk
// spliced out of it is never written over.
type spillFile struct {
	f   *os.File
	end int64
}

// spareFile is an emptied temporary file of the extract directory.
type spareFile struct {
	fd   *os.File
	path string
}

// maxSpareLocked caps the temporary files kept empty for reuse: as many
// files as may be arriving at once (a DATA frame of each queued for the
// workers, on them, or on its way from a shard's reader), so that a file
// is removed only when fewer arrive at once than did before.
func (s *StreamSource) maxSpareLocked() int { return 2*s.opts.Workers + s.shards }

// maxSpillFiles caps how many files a stream spills into (8 tmpfs files
// written at once took 18.7 GB/s, one 3.5); a variable for the benchmark
// that compares one file against several.
var maxSpillFiles = 8

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
	// those of them decoded.
	ahead, aheadIn int
}

// arrivedLocked says f's end is known and the chunks read ahead of it are
// in: a stream written with data after its FILE-END (a capture's page
// images last, streamer/late.go) may then be served as it arrives.
func (f *streamFile) arrivedLocked() bool {
	return f.size >= 0 && f.aheadIn >= f.ahead
}

// ErrMemoryLimit means what a stream holds would exceed Options.MemoryLimit
// where it cannot spill.
var ErrMemoryLimit = errors.New("memory limit reached")

// ErrNoSpace means a stream would fill the file system it spills or
// extracts to: its chunks may declare far more than it carries.
var ErrNoSpace = errors.New("not enough free space")

// spaceLeft is the free space on f's file system for an unprivileged
// writer, and its size (a variable for tests).
var spaceLeft = func(f *os.File) (avail, total int64, err error) {
	var st unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &st); err != nil {
		return 0, 0, err
	}
	return int64(st.Bavail) * st.Bsize, int64(st.Blocks) * st.Bsize, nil
}

// RoomFor refuses to write n more bytes to f when that would leave less
// than a reserve (5% of the file system, at most 1 GiB) free: a stream of
// well-compressed chunks must not fill the disk it spills to.
func RoomFor(f *os.File, n int64) error {
	avail, total, err := spaceLeft(f)
	if err != nil {
		return nil // unknown: a full disk still fails the write
	}
	reserve := min(total/20, 1<<30)
	if n > avail-reserve {
		return fmt.Errorf("%s: %d more bytes would leave less than %d of its file system's %d free bytes: %w", f.Name(), n, reserve, avail, ErrNoSpace)
	}
	return nil
}

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
		extractDir: so.ExtractDir,
		spillDir:   so.SpillDir,
		discard:    so.Discard,
		early:      so.ServeEarly,
		log:        so.Log,
		changed:    make(chan struct{}),
		pending:    map[uint32]*streamFile{},
		doneIDs:    map[uint32]bool{},
		complete:   map[string]*streamFile{},
		retired:    map[*streamFile]bool{},
		cancel:     cancel,
		shardBytes: make([]int64, len(shards)),
		shards:     len(shards),
		spillMax:   max(1, min(runtime.GOMAXPROCS(0), maxSpillFiles)),
	}
	s.inflight = newInflight(s.opts.MemoryLimit / 4)
	s.pages = pagePool{size: pipeline.DefaultChunkSize, keep: 2*s.opts.Workers + 2}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		err := s.run(ctx, shards, names)
		s.mu.Lock()
		defer s.mu.Unlock()
		if err == nil && len(s.pending) > 0 {
			for _, f := range s.pending {
				err = fmt.Errorf("stream ended but file %s is incomplete (%d chunks received)", manifest.PrintableName(f.name), len(f.chunks))
				break
			}
		}
		if err != nil && s.err == nil {
			s.err = err
		}
		if s.err == nil {
			s.err = s.publishLocked()
		}
		s.dropSpareLocked()
		if s.err != nil {
			// A failed extract leaves nothing behind, not even the files
			// it finished: the image is incomplete.
			for _, p := range s.extracted {
				os.Remove(p)
			}
			s.extracted = nil
		}
		s.ended = true
		s.notifyLocked()
	}()
	return s
}

func (s *StreamSource) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

type decodeJob struct {
	rd       *manifest.Reader
	frame    manifest.Frame
	page     *pageBuf // the payload's page buffer, or nil
	acquired int64    // what it acquired of s.inflight
	// spilled: the budget had no room for it; its payload, and its raw
	// bytes once decoded, live in spill-file buffers.
	spilled bool
	ahead   bool // read before its file's end was known (streamFile.ahead)
}

// run reads all shards concurrently and decodes DATA frames on workers.
func (s *StreamSource) run(ctx context.Context, shards []io.Reader, names []string) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	jobs := make(chan decodeJob, s.opts.Workers)
	var workers sync.WaitGroup
	for range s.opts.Workers {
		workers.Add(1)
		go func() {
			defer workers.Done()
			for j := range jobs {
				if ctx.Err() != nil {
					s.putPage(j.page)
				} else if err := s.decode(j); err != nil {
					cancel(err)
				}
				s.inflight.release(j.acquired)
			}
		}()
	}
	// A shard blocked in Read would hold up the end of the run: closing
	// what can be closed wakes it (the CLI hands in pollable files).
	stop := context.AfterFunc(ctx, func() {
		for _, r := range shards {
			if c, ok := r.(io.Closer); ok {
				c.Close()
			}
		}
	})
	defer stop()
	var readers sync.WaitGroup
	var idMu sync.Mutex
	var streamID uint64
	var enc *manifest.Encryption
	for i, r := range shards {
		readers.Add(1)
		go func() {
			defer readers.Done()
			rd, err := manifest.NewReader(r, names[i])
			if err != nil {
				cancel(err)
				return
			}
			h := rd.Header()
			idMu.Lock()
			first := streamID == 0
			if first {
				streamID, enc = h.StreamID, h.Encryption
				s.seal, err = pipeline.OpenSession(s.opts.Key, enc)
				s.sums = pipeline.Digester{Seal: s.seal, NoChunkHashes: h.NoChunkHashes}
			}
			same := streamID == h.StreamID && (enc == nil) == (h.Encryption == nil) && (enc == nil || *enc == *h.Encryption) &&
				s.sums.NoChunkHashes == h.NoChunkHashes
			seal := s.seal
			idMu.Unlock()
			if seal != nil {
				pipeline.CheckEnd(rd, seal)
			} else {
				rd.BorrowPayloads() // only sealed payloads are written (opened in place)
			}
			if first && err != nil {
				cancel(fmt.Errorf("%s: %w", names[i], err))
				return
			}
			if !same {
				cancel(fmt.Errorf("%s: shard belongs to another stream", names[i]))
				return
			}
			if int(h.ShardCount) != len(shards) {
				cancel(fmt.Errorf("%s: stream has %d shards, %d given", names[i], h.ShardCount, len(shards)))
				return
			}
			err = s.readShard(ctx, rd, jobs)
			s.mu.Lock()
			s.shardBytes[i] = rd.Pos()
			s.mu.Unlock()
			if err != nil {
				cancel(err)
			}
		}()
	}
	readers.Wait()
	close(jobs)
	workers.Wait()
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	return nil
}

func (s *StreamSource) readShard(ctx context.Context, rd *manifest.Reader, jobs chan<- decodeJob) error {
	late := false
	for {
		if err := ctx.Err(); err != nil {
			return context.Cause(ctx)
		}
		var page *pageBuf
		var acquired int64
		spilled := false
		fr, err := rd.Next(func(fh manifest.FrameHeader) ([]byte, error) {
			// Its payload and, decoded elsewhere, its raw bytes.
			n := int(fh.StoredLen)
			want := int64(n)
			if codec.ID(fh.Codec) != codec.None {
				want += int64(min(fh.RawLen, codec.MaxChunk))
			}
			fits, err := s.inflight.acquire(ctx, want)
			if err != nil {
				return nil, err
			}
			if !fits {
				spilled = true
				if page, err = newFileBuf(s.spillDir, n); err != nil {
					return nil, fmt.Errorf("no room for a %d-byte frame in --memory-limit: %w", n, err)
				}
				return page.b[:n], nil
			}
			acquired = want
			if n < minSpliceChunk || s.discard || s.extractDir != "" {
				return make([]byte, n), nil
			}
			p, err := s.pages.get(n)
			if err != nil {
				return make([]byte, n), nil // no mapping: the heap will do
			}
			page = p
			return p.b[:n], nil
		})
		s.inflight.read(acquired)
		if err != nil {
			s.putPage(page)
			s.inflight.release(acquired)
			if err == io.EOF {
				return nil
			}
			return err
		}
		switch fr.Type {
		case manifest.FrameFile:
			if err := s.openFile(rd, fr); err != nil {
				return err
			}
		case manifest.FrameData:
			if fr.RawLen == 0 || fr.RawLen > codec.MaxChunk {
				s.putPage(page)
				s.inflight.release(acquired)
				return rd.FrameErrorf(fr, "DATA frame with raw length %d", fr.RawLen)
			}
			ahead := false
			if s.early {
				// What serving files as they arrive needs (file,
				// arrivedLocked); nothing else reads it.
				s.mu.Lock()
				f := s.pending[fr.FileID]
				if ahead = f != nil && f.size < 0; ahead {
					f.ahead++
				}
				if fr.Late && !late {
					late = true
					s.lateShards++
					s.notifyLocked() // a name not announced yet never comes
				}
				s.mu.Unlock()
			}
			select {
			case jobs <- decodeJob{rd, fr, page, acquired, spilled, ahead}:
			case <-ctx.Done():
				s.putPage(page)
				s.inflight.release(acquired)
				return context.Cause(ctx)
			}
		case manifest.FrameFileEnd:
			if err := s.endFile(rd, fr); err != nil {
				return err
			}
		}
	}
}

func (s *StreamSource) openFile(rd *manifest.Reader, fr manifest.Frame) error {
	name := string(fr.Payload)
	if !manifest.ValidName(name) {
		return rd.FrameErrorf(fr, "FILE frame with unsafe name %s", manifest.PrintableName(name))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.doneIDs[fr.FileID] {
		return nil // announced again by a shard that lags behind
	}
	if f, ok := s.pending[fr.FileID]; ok {
		if f.name != name {
			return rd.FrameErrorf(fr, "file id %d reopened as %s", fr.FileID, manifest.PrintableName(name))
		}
		return nil // the same announcement on another shard or segment
	}
	f := &streamFile{id: fr.FileID, name: name, external: fr.Flags&manifest.FileFlagExternal != 0, carried: fr.Flags&manifest.FileFlagCarried != 0, size: -1}
	s.pending[fr.FileID] = f
	if err := s.addMetaLocked(f, fileMeta+2*int64(len(name))); err != nil {
		return err
	}
	if k := len(s.spare); k > 0 && s.extractDir != "" {
		f.fd, f.tmpPath = s.spare[k-1].fd, s.spare[k-1].path
		s.spare = s.spare[:k-1]
	} else if s.extractDir != "" {
		// A fresh name, created exclusively: whatever was planted in the
		// directory (a symlink to a victim) is never opened.
		fd, err := os.CreateTemp(s.extractDir, fmt.Sprintf(".%s.partial-%d-*", name, fr.FileID))
		if err != nil {
			return fmt.Errorf("extract %s: %w", manifest.PrintableName(name), err)
		}
		f.fd, f.tmpPath = fd, fd.Name()
	}
	return nil
}

func (s *StreamSource) endFile(rd *manifest.Reader, fr manifest.Frame) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	f, ok := s.pending[fr.FileID]
	if !ok {
		return nil // completed already through another shard's FILE-END
	}
	if f.size >= 0 {
		if f.size != int64(fr.Offset) || f.expect != fr.RawLen || f.digest != fr.Hash {
			return rd.FrameErrorf(fr, "FILE-END disagrees with another shard's")
		}
		return nil
	}
	f.size, f.expect, f.digest = int64(fr.Offset), fr.RawLen, fr.Hash
	if s.early {
		s.notifyLocked() // Stat and Copy may take it as it arrives
	}
	return s.maybeCompleteLocked(f, func() error { return rd.FrameErrorf(fr, "file check failed") })
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

// replacedLocked releases f, replaced by a later copy. In extract mode
// its temporary file, emptied, is kept for the next file, unless a Copy
// of a file served early may read it still: created and removed for each
// of 100,000 copies of one file, temporary files took 36 s of a 42 s
// extract (on ext4 each create searches the inodes recently deleted).
func (s *StreamSource) replacedLocked(f *streamFile) {
	if f.fd != nil && !s.early && f.copies == 0 && len(s.spare) < s.maxSpareLocked() && f.fd.Truncate(0) == nil {
		s.spare = append(s.spare, spareFile{f.fd, f.tmpPath})
		f.fd, f.tmpPath = nil, ""
	}
	s.dropLocked(f)
}

// dropSpareLocked removes the spare temporary files: the stream ended,
// and the directory holds the files it extracted alone.
func (s *StreamSource) dropSpareLocked() {
	for _, sp := range s.spare {
		sp.fd.Close()
		os.Remove(sp.path)
	}
	s.spare = nil
}

// dropLocked releases f and removes its temporary file in extract mode.
func (s *StreamSource) dropLocked(f *streamFile) {
	if f.tmpPath != "" {
		os.Remove(f.tmpPath)
		f.tmpPath = ""
	}
	s.releaseLocked(f)
}

// publishLocked renames the extracted files into place once the whole
// stream is in and checked: a stream that replaces one file 100,000 times
// renames it once (renaming over an existing file flushes its data on
// ext4: 6 minutes for 100,000), and a stream that fails renames none.
func (s *StreamSource) publishLocked() error {
	for _, f := range s.complete {
		if f.tmpPath == "" {
			continue
		}
		final := filepath.Join(s.extractDir, f.name)
		if err := os.Rename(f.tmpPath, final); err != nil {
			return fmt.Errorf("extract %s: %w", manifest.PrintableName(f.name), err)
		}
		s.extracted = append(s.extracted, final)
		f.tmpPath = ""
	}
	return nil
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

// decodePayload checks one DATA frame and decodes it: raw is nil for a
// zero chunk, and lies in page where it was decoded into one (or read into
// one, for a chunk stored raw: checked in place, no second copy).
func (s *StreamSource) decodePayload(j decodeJob) (raw []byte, page *pageBuf, err error) {
	fr := j.frame
	// The payload's buffer goes back once decoded, unless it is the chunk.
	defer func() { s.putPage(j.page) }()
	if s.sums.NoChunkHashes && fr.Hash != ([32]byte{}) {
		return nil, nil, j.rd.FrameErrorf(fr, "chunk at file offset %d has a hash in a stream without chunk hashes", fr.Offset)
	}
	if s.seal != nil {
		// Opened in place: the payload shrinks to its plaintext in the
		// same buffer (a raw chunk read into a page stays the chunk).
		ch := crypt.Chunk{FileID: fr.FileID, Name: fr.Name, Offset: fr.Offset, RawLen: fr.RawLen, Codec: fr.Codec}
		if fr.Payload, fr.Checksum, err = openChunk(s.seal, fr.Payload, ch); err != nil {
			return nil, nil, j.rd.FrameErrorf(fr, "chunk at file offset %d: %v", fr.Offset, err)
		}
	}
	if codec.ID(fr.Codec) == codec.Zero {
		if len(fr.Payload) != 0 {
			return nil, nil, j.rd.FrameErrorf(fr, "zero chunk with a payload of %d bytes", len(fr.Payload))
		}
		if crc, hash := s.sums.Zero(int(fr.RawLen)); crc != fr.Checksum || (s.opts.VerifyHashes && hash != fr.Hash) {
			return nil, nil, j.rd.FrameErrorf(fr, "zero chunk with a checksum that is not of zeros")
		}
		return nil, nil, nil
	}
	// Large chunks that may stay in memory are decoded into page buffers,
	// which Copy can splice into CRIU's pipe (splice.go).
	raw = fr.Payload
	switch {
	case borrowedRaw(fr): // checked where it lies: it stays the chunk
	case j.page != nil && codec.ID(fr.Codec) == codec.None:
		page, j.page = j.page, nil
	case j.spilled && codec.ID(fr.Codec) != codec.None:
		if page, err = newFileBuf(s.spillDir, int(fr.RawLen)); err != nil {
			return nil, nil, fmt.Errorf("decode chunk at file offset %d: %w", fr.Offset, err)
		}
		raw = page.b[:fr.RawLen]
	case !s.discard && s.extractDir == "" && fr.RawLen >= minSpliceChunk:
		if page, err = s.pages.get(int(fr.RawLen)); err != nil {
			return nil, nil, fmt.Errorf("decode chunk at file offset %d: %w", fr.Offset, err)
		}
		raw = page.b[:fr.RawLen]
	case codec.ID(fr.Codec) != codec.None:
		raw = make([]byte, fr.RawLen)
	}
	err = decodeChunk(raw, fr.Codec, fr.Checksum, fr.Payload) // in place: only read
	if err == nil && s.opts.VerifyHashes && s.sums.Content(raw) != fr.Hash {
		err = errors.New("content hash mismatch")
	}
	if err != nil {
		if page != nil {
			page.free()
		}
		return nil, nil, j.rd.FrameErrorf(fr, "chunk at file offset %d: %v", fr.Offset, err)
	}
	return raw, page, nil
}

// borrowedRaw says whether fr's payload is the reader's memory (Frame.Borrowed)
// and its raw bytes (codec none): then it is the chunk, where it lies.
func borrowedRaw(fr manifest.Frame) bool { return fr.Borrowed && codec.ID(fr.Codec) == codec.None }

// decode checks one DATA frame and stores its bytes.
func (s *StreamSource) decode(j decodeJob) error {
	fr := j.frame
	raw, page, err := s.decodePayload(j)
	if err != nil {
		return err
	}
	zero := codec.ID(fr.Codec) == codec.Zero
	borrowed := borrowedRaw(fr)
	rec := chunkRec{off: int64(fr.Offset), n: int64(fr.RawLen), crc: fr.Checksum, hash: fr.Hash, zero: zero}
	s.Counters.RawBytes.Add(int64(fr.RawLen))
	s.Counters.StoredBytes.Add(int64(fr.StoredLen))
	s.Counters.StoredRaw.Add(int64(fr.RawLen))

	s.mu.Lock()
	f, ok := s.pending[fr.FileID]
	if !ok {
		s.mu.Unlock()
		return j.rd.FrameErrorf(fr, "DATA frame after its file was complete")
	}
	if !zero && !s.discard {
		switch {
		case f.fd != nil:
			rec.fd, rec.foff = f.fd, rec.off
		case borrowed:
			rec.mem, rec.borrowed = raw, true
		case s.memUsed+s.metaUsed+memCost(raw, page) <= s.opts.MemoryLimit-s.inflight.max:
			rec.mem, rec.page = raw, page
			if page != nil {
				page.trim(len(raw))
			}
			page = nil
			s.memUsed += rec.memCost()
		default:
			if rec.fd, rec.foff, err = s.spillAtLocked(int64(len(raw))); err != nil {
				s.mu.Unlock()
				if page != nil {
					page.free()
				}
				return err
			}
		}
	}
	s.mu.Unlock()
	if rec.fd != nil {
		err := RoomFor(rec.fd, int64(len(raw)))
		if err == nil {
			_, err = rec.fd.WriteAt(raw, rec.foff)
		}
		if page != nil {
			page.free() // spilled: the bytes live in the file now
		}
		if err != nil {
			return fmt.Errorf("store %s at offset %d: %w", manifest.PrintableName(f.name), rec.off, err)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	f.chunks = append(f.chunks, rec)
	if j.ahead {
		f.aheadIn++
	}
	s.chunks++
	if err := s.addMetaLocked(f, chunkMeta); err != nil {
		return err
	}
	if s.early && f.size >= 0 {
		s.notifyLocked() // a Copy of it as it arrives may take this chunk
	}
	return s.maybeCompleteLocked(f, func() error { return j.rd.FrameErrorf(fr, "file check failed") })
}

// spillAtLocked reserves n bytes in a spill file and says where. Chunks
// go to the files in turn: one file's writes serialize on its inode lock
// (buffered writes to one tmpfs file top out near 3.5 GB/s whatever the
// number of writers, several files scale), so concurrent decoders must
// write different files. Round robin under the lock needs no notion of
// which goroutine writes, fills the files evenly, and two decoders share a
// file only when one write lags spillMax others; the files are created as
// the turn first reaches them, so a stream that spills a little makes few.
func (s *StreamSource) spillAtLocked(n int64) (*os.File, int64, error) {
	i := s.spillNext % s.spillMax
	if i == len(s.spills) {
		f, err := os.CreateTemp(s.spillDir, "gpucr-spill-*")
		if err != nil {
			return nil, 0, fmt.Errorf("spill to disk: %w", err)
		}
		os.Remove(f.Name()) // unlinked: gone when closed, even after a crash
		s.spills = append(s.spills, spillFile{f: f})
	}
	s.spillNext++
	sp := &s.spills[i]
	off := sp.end
	sp.end += n
	return sp.f, off, nil
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

// entry lists the file's chunks too, as decoded: Codec says only which
// are zero (codec.Zero; the others codec.None), which is what a sparse
// serve of a pages image needs (criusock/sparse.go).
func (f *streamFile) entry() manifest.File {
	m := manifest.File{Name: f.name, Size: f.size, Digest: f.digest, External: f.external, Carried: f.carried}
	if len(f.chunks) > 0 {
		m.Chunks = make([]manifest.Chunk, len(f.chunks))
		for i, c := range f.chunks {
			m.Chunks[i] = manifest.Chunk{Offset: c.off, RawLen: uint32(c.n), Checksum: c.crc, Hash: c.hash, Codec: uint8(codec.None)}
			if c.zero {
				m.Chunks[i].Codec = uint8(codec.Zero)
			}
		}
		// A file still arriving has them in the order they came.
		sort.Slice(m.Chunks, func(i, j int) bool { return m.Chunks[i].Offset < m.Chunks[j].Offset })
	}
	return m
}

// Stat implements Source. With ServeEarly, a file still arriving (see
// arrivedLocked) is listed with the chunks in so far: those sent ahead of
// its end, such as a page image's zero chunks.
func (s *StreamSource) Stat(ctx context.Context, name string) (manifest.File, error) {
	f, err := s.file(ctx, name, true, false)
	if err != nil {
		return manifest.File{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return f.entry(), nil
}

// file waits until the named file is complete (or the stream ended) and
// returns it; with arriving and ServeEarly, also a file still arriving
// (arrivedLocked), the latest opened of that name. With copying, its
// memory is kept for the caller until it calls copyEnd.
func (s *StreamSource) file(ctx context.Context, name string, arriving, copying bool) (*streamFile, error) {
	var f *streamFile
	err := s.wait(ctx, func() bool {
		f = s.complete[name]
		if f == nil && s.early {
			arrived, pending := s.pendingLocked(name)
			if arriving {
				f = arrived
			}
			if !pending && s.lateShards == s.shards {
				return true // announced nowhere, and no more files come
			}
		}
		ready := (f != nil && s.early) || s.ended
		if ready && f != nil && copying {
			f.copies++
		}
		return ready
	})
	if err != nil {
		return nil, err
	}
	if f == nil {
		return nil, fmt.Errorf("%s: %w", name, errdefs.ErrNotFound)
	}
	return f, nil
}

// pendingLocked says whether a file of that name is still arriving, and
// which of them, the latest opened, may be served as it arrives
// (arrivedLocked; nil: none).
func (s *StreamSource) pendingLocked(name string) (arrived *streamFile, pending bool) {
	for _, p := range s.pending {
		if p.name != name {
			continue
		}
		pending = true
		if p.arrivedLocked() && (arrived == nil || p.id > arrived.id) {
			arrived = p
		}
	}
	return arrived, pending
}

// Files implements Source.
func (s *StreamSource) Files(ctx context.Context) ([]manifest.File, error) {
	if err := s.Wait(ctx); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]manifest.File, 0, len(s.complete))
	for _, f := range s.complete {
		out = append(out, f.entry())
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// Copy implements Source. With ServeEarly, a file still arriving is
// copied as it arrives (copyArriving).
func (s *StreamSource) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	f, err := s.file(ctx, name, true, true)
	if err != nil {
		return 0, err
	}
	defer s.copyEnd(f)
	if s.discard {
		return 0, fmt.Errorf("copy %s: stream source keeps no data", name)
	}
	cw := newChunkWriter(w)
	var buf []byte
	s.mu.Lock()
	done := s.doneIDs[f.id]
	s.mu.Unlock()
	var next int64
	if !done {
		s.logArriving(f)
		if next, err = s.copyArriving(ctx, f, cw, w, &buf); err != nil {
			return next, fmt.Errorf("copy %s at offset %d: %w", name, next, err)
		}
	}
	s.mu.Lock()
	chunks := f.chunks
	s.mu.Unlock()
	written := next
	for _, c := range chunks {
		if c.off < next {
			continue // copied as it arrived
		}
		if err := ctx.Err(); err != nil {
			return written, err
		}
		if err := copyChunk(cw, w, c, &buf); err != nil {
			return written, fmt.Errorf("copy %s at offset %d: %w", name, c.off, err)
		}
		written += c.n
	}
	return written, nil
}

// logArriving says that f, still arriving, is copied as it arrives.
func (s *StreamSource) logArriving(f *streamFile) {
	if s.log == nil {
		return
	}
	s.mu.Lock()
	var in int64
	for _, c := range f.chunks {
		in += c.n
	}
	size := f.size
	s.mu.Unlock()
	s.log(fmt.Sprintf("%s: copied as it arrives (%d of its %d bytes in)", manifest.PrintableName(f.name), in, size))
}

// copyArriving copies f, a file whose end is known but not all its chunks,
// in file order as they come, each once it is in and checked, and returns
// once f is complete, with how far it copied. Its last chunk waits for the
// whole file to check (maybeCompleteLocked): its reader never has all of a
// file that does not verify, and a stream that fails ends the copy short.
func (s *StreamSource) copyArriving(ctx context.Context, f *streamFile, cw chunkWriter, w io.Writer, buf *[]byte) (int64, error) {
	var next int64
	for {
		var c chunkRec
		found, done := false, false
		err := s.wait(ctx, func() bool {
			if done = s.doneIDs[f.id]; done {
				return true
			}
			for _, r := range f.chunks {
				if r.off == next && next+r.n < f.size {
					c, found = r, true
					return true
				}
			}
			return s.ended
		})
		switch {
		case err != nil:
			return next, err
		case done:
			s.mu.Lock()
			replaced := s.complete[f.name] != f
			s.mu.Unlock()
			if replaced {
				return next, fmt.Errorf("replaced by a later copy of it while it was copied: %w", errdefs.ErrCorrupt)
			}
			return next, nil
		case !found:
			return next, fmt.Errorf("stream ended with the file incomplete: %w", errdefs.ErrCorrupt)
		}
		if err := copyChunk(cw, w, c, buf); err != nil {
			return next, err
		}
		next += c.n
	}
}

// copyChunk writes one chunk to w (through cw).
func copyChunk(cw chunkWriter, w io.Writer, c chunkRec, buf *[]byte) error {
	switch {
	case c.zero:
		return cw.zeros(c.n)
	case c.page != nil || c.borrowed:
		// Never written after decoding, so it may be spliced; the mapping
		// lasts until Close, the pipe's references beyond.
		_, err := cw.write(c.mem)
		return err
	case c.mem != nil:
		_, err := w.Write(c.mem)
		return err
	default:
		if int64(cap(*buf)) < c.n && cw.pipe == nil {
			*buf = make([]byte, c.n)
		}
		return cw.fromFile(c.fd, c.foff, c.n, *buf)
	}
}

// CopyToFile writes the named file into f, a regular file of no data,
// through a shared mapping of it on several goroutines: writes to one file
// are serialized by its inode's lock (a lazy restore's pages image, 4 GiB
// written by Copy, took 1.1 s of its downtime on 16 cores), the faults of a
// mapping are not. Zero chunks are left as holes.
func (s *StreamSource) CopyToFile(ctx context.Context, name string, f *os.File) (int64, error) {
	sf, err := s.file(ctx, name, false, true)
	if err != nil {
		return 0, err
	}
	defer s.copyEnd(sf)
	if s.discard {
		return 0, fmt.Errorf("copy %s: stream source keeps no data", name)
	}
	s.mu.Lock()
	chunks, size := sf.chunks, sf.size
	s.mu.Unlock()
	if err := f.Truncate(size); err != nil || size == 0 {
		return 0, err
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return 0, fmt.Errorf("copy %s: map the file: %w", name, err)
	}
	defer unix.Munmap(m)
	var next atomic.Int64
	workers := min(runtime.GOMAXPROCS(0), 8)
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := next.Add(1) - 1; i < int64(len(chunks)); i = next.Add(1) - 1 {
				c := chunks[i]
				if err := ctx.Err(); err != nil {
					errs[w] = err
					return
				}
				if c.off < 0 || c.off+c.n > size {
					errs[w] = fmt.Errorf("copy %s: chunk at offset %d of %d bytes beyond the file's %d: %w", name, c.off, c.n, size, errdefs.ErrCorrupt)
					return
				}
				dst := m[c.off : c.off+c.n]
				switch {
				case c.zero: // a hole
				case c.mem != nil:
					copy(dst, c.mem)
				default:
					if _, err := c.fd.ReadAt(dst, c.foff); err != nil {
						errs[w] = fmt.Errorf("copy %s at offset %d: %w", name, c.off, err)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	return size, nil
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
	s.dropSpareLocked()
	s.metaUsed -= doneMeta * int64(len(s.doneIDs))
	for f := range s.retired {
		s.freeLocked(f) // Close comes after every Copy
	}
	s.pages.close()
	for _, sp := range s.spills {
		sp.f.Close()
	}
	s.spills = nil
	return nil
}
