package source

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
)

// A StreamSource's intake: one reader per shard reads frames, keeps the
// file table (FILE, FILE-END) and queues DATA frames for the decoders,
// which check each chunk and store it (in memory, a spill file, or the
// file an extract writes).

// payloadBuf is where a DATA frame's payload was read (allocPayload).
type payloadBuf struct {
	page     *pageBuf // its page buffer, or nil (the heap)
	acquired int64    // what it acquired of StreamSource.inflight
	// spilled: the budget had no room for it; its payload, and its raw
	// bytes once decoded, live in spill-file buffers.
	spilled bool
}

type decodeJob struct {
	rd    *manifest.Reader
	frame manifest.Frame
	payloadBuf
	ahead bool // read before its file's end was known (streamFile.ahead)
}

// streamJoin is what every shard's header must share with the first one
// read (join).
type streamJoin struct {
	mu       sync.Mutex
	streamID uint64
	enc      *manifest.Encryption
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
	var join streamJoin
	for i, r := range shards {
		readers.Add(1)
		go func() {
			defer readers.Done()
			if err := s.shard(ctx, i, r, names[i], &join, jobs); err != nil {
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

// shard reads shard i, named name: its header, then its frames.
func (s *StreamSource) shard(ctx context.Context, i int, r io.Reader, name string, join *streamJoin, jobs chan<- decodeJob) error {
	rd, err := manifest.NewReader(r, name)
	if err != nil {
		return err
	}
	if err := s.join(rd, name, join); err != nil {
		return err
	}
	err = s.readShard(ctx, rd, jobs)
	s.mu.Lock()
	s.shardBytes[i] = rd.Pos()
	s.mu.Unlock()
	return err
}

// join checks rd's header against the first shard's; the first sets up
// how chunks are opened and checked (s.seal, s.sums).
func (s *StreamSource) join(rd *manifest.Reader, name string, j *streamJoin) error {
	h := rd.Header()
	var err error
	j.mu.Lock()
	first := j.streamID == 0
	if first {
		j.streamID, j.enc = h.StreamID, h.Encryption
		s.seal, err = pipeline.OpenSession(s.opts.Key, j.enc)
		s.sums = pipeline.Digester{Seal: s.seal, NoChunkHashes: h.NoChunkHashes}
	}
	same := j.streamID == h.StreamID && (j.enc == nil) == (h.Encryption == nil) && (j.enc == nil || *j.enc == *h.Encryption) &&
		s.sums.NoChunkHashes == h.NoChunkHashes
	seal := s.seal
	j.mu.Unlock()
	if seal != nil {
		pipeline.CheckEnd(rd, seal)
	} else {
		rd.BorrowPayloads() // only sealed payloads are written (opened in place)
	}
	switch {
	case first && err != nil:
		return fmt.Errorf("%s: %w", name, err)
	case !same:
		return fmt.Errorf("%s: shard belongs to another stream", name)
	case int(h.ShardCount) != s.shards:
		return fmt.Errorf("%s: stream has %d shards, %d given", name, h.ShardCount, s.shards)
	}
	return nil
}

// readShard reads rd's frames to its end.
func (s *StreamSource) readShard(ctx context.Context, rd *manifest.Reader, jobs chan<- decodeJob) error {
	late := false // a late DATA frame was read (stream_early.go)
	for {
		if err := ctx.Err(); err != nil {
			return context.Cause(ctx)
		}
		var p payloadBuf
		fr, err := rd.Next(func(fh manifest.FrameHeader) (b []byte, err error) {
			p, b, err = s.allocPayload(ctx, fh)
			return b, err
		})
		s.inflight.read(p.acquired)
		if err != nil {
			s.dropPayload(p)
			if err == io.EOF {
				return nil
			}
			return err
		}
		switch fr.Type {
		case manifest.FrameFile:
			err = s.openFile(rd, fr)
		case manifest.FrameData:
			err = s.queue(ctx, rd, fr, p, &late, jobs)
		case manifest.FrameFileEnd:
			err = s.endFile(rd, fr)
		}
		if err != nil {
			return err
		}
	}
}

// allocPayload places a DATA frame's payload before it is read
// (manifest.Alloc). Its stored bytes and, decoded elsewhere, its raw bytes
// take room in the budget for frames in flight (s.inflight): there it is
// read into a page buffer where its chunk may be spliced, else onto the
// heap. With no room, it is read into a spill file's pages.
func (s *StreamSource) allocPayload(ctx context.Context, fh manifest.FrameHeader) (payloadBuf, []byte, error) {
	n := int(fh.StoredLen)
	want := int64(n)
	if codec.ID(fh.Codec) != codec.None {
		want += int64(min(fh.RawLen, codec.MaxChunk))
	}
	fits, err := s.inflight.acquire(ctx, want)
	if err != nil {
		return payloadBuf{}, nil, err
	}
	if !fits {
		page, err := newFileBuf(s.spill.dir, n)
		if err != nil {
			return payloadBuf{spilled: true}, nil, fmt.Errorf("no room for a %d-byte frame in --memory-limit: %w", n, err)
		}
		return payloadBuf{page: page, spilled: true}, page.b[:n], nil
	}
	p := payloadBuf{acquired: want}
	if n < minSpliceChunk || !s.inMemory() {
		return p, make([]byte, n), nil
	}
	page, err := s.pages.get(n)
	if err != nil {
		return p, make([]byte, n), nil // no mapping: the heap will do
	}
	p.page = page
	return p, page.b[:n], nil
}

// dropPayload gives back what a frame that is not decoded took.
func (s *StreamSource) dropPayload(p payloadBuf) {
	s.putPage(p.page)
	s.inflight.release(p.acquired)
}

// queue hands a DATA frame, its payload in p, to the decoders.
func (s *StreamSource) queue(ctx context.Context, rd *manifest.Reader, fr manifest.Frame, p payloadBuf, late *bool, jobs chan<- decodeJob) error {
	if fr.RawLen == 0 || fr.RawLen > codec.MaxChunk {
		s.dropPayload(p)
		return rd.FrameErrorf(fr, "DATA frame with raw length %d", fr.RawLen)
	}
	ahead := s.early != nil && s.noteEarly(fr, late)
	select {
	case jobs <- decodeJob{rd, fr, p, ahead}:
		return nil
	case <-ctx.Done():
		s.dropPayload(p)
		return context.Cause(ctx)
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
	if s.extract != nil {
		var err error
		if f.fd, f.tmpPath, err = s.extract.create(name, fr.FileID); err != nil {
			return err
		}
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
	if s.early != nil {
		s.notifyLocked() // Stat and Copy may take it as it arrives
	}
	return s.maybeCompleteLocked(f, func() error { return rd.FrameErrorf(fr, "file check failed") })
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
		if page, err = newFileBuf(s.spill.dir, int(fr.RawLen)); err != nil {
			return nil, nil, fmt.Errorf("decode chunk at file offset %d: %w", fr.Offset, err)
		}
		raw = page.b[:fr.RawLen]
	case s.inMemory() && fr.RawLen >= minSpliceChunk:
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
	rec := chunkRec{off: int64(fr.Offset), n: int64(fr.RawLen), crc: fr.Checksum, hash: fr.Hash, zero: codec.ID(fr.Codec) == codec.Zero}
	s.Counters.RawBytes.Add(int64(fr.RawLen))
	s.Counters.StoredBytes.Add(int64(fr.StoredLen))
	s.Counters.StoredRaw.Add(int64(fr.RawLen))

	s.mu.Lock()
	f, ok := s.pending[fr.FileID]
	if !ok {
		s.mu.Unlock()
		return j.rd.FrameErrorf(fr, "DATA frame after its file was complete")
	}
	page, err = s.placeLocked(f, &rec, raw, page, borrowedRaw(fr))
	s.mu.Unlock()
	if err != nil {
		if page != nil {
			page.free()
		}
		return err
	}
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
	if s.early != nil && f.size >= 0 {
		s.notifyLocked() // a Copy of it as it arrives may take this chunk
	}
	return s.maybeCompleteLocked(f, func() error { return j.rd.FrameErrorf(fr, "file check failed") })
}

// placeLocked decides where the raw bytes of rec, a chunk of f, are kept:
// the file an extract writes, the reader's memory where they lie
// (borrowed), memory within the budget, or a spill file. rec.fd set, they
// are to be written there. It returns page unless the chunk keeps it.
func (s *StreamSource) placeLocked(f *streamFile, rec *chunkRec, raw []byte, page *pageBuf, borrowed bool) (*pageBuf, error) {
	if rec.zero || s.discard {
		return page, nil
	}
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
		s.memUsed += rec.memCost()
		return nil, nil
	default:
		var err error
		if rec.fd, rec.foff, err = s.spill.at(int64(len(raw))); err != nil {
			return page, err
		}
	}
	return page, nil
}
