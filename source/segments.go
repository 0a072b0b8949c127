package source

// A reader of an archive reads each chunk's frame where the manifest
// places it (fetch) and nothing else of a segment: the stream header, the
// KEY, FILE, FILE-END and END frames, the tail, the frames of zero chunks
// (their bytes come from the manifest) and those of a file written twice
// (the manifest lists the later copy only) are read by no restore. So
// damage there passed every check cp and verify made. CheckSegments reads
// exactly those bytes (docs/FORMAT.md section 10, "What cp and verify
// check"); with the chunks' own reads, every byte of every segment of a
// plain archive is checked.

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"sync"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
)

// coalesce: chunk frames of at most this many bytes in all between two
// stretches CheckSegments reads are read through rather than skipped by
// another request (a small file's chunk lies between its FILE and
// FILE-END frames).
const coalesce = 64 << 10

// CheckSegments checks every byte of a plain archive's segments that
// reading its chunks does not: each segment is there at the manifest's
// size; its stream header (shard 0 of 1, the manifest's encryption and
// chunk hashes, one stream id in all segments) and KEY frame; each frame
// between the chunks' frames, header (its CRC and field rules) and payload
// (FILE: CRC-32C and a valid name; a zero chunk's DATA frame: against the
// manifest's entry, opened when sealed; another chunk's, of a file written
// twice: decoded and checked as any chunk; FILE-END: no payload), ending
// exactly where the next chunk's frame begins; the END frame with an empty
// payload, and the tail that points at it and ends the segment. A damaged
// byte is an error wrapping errdefs.ErrCorrupt that names the segment and
// the offset. Not checked: the END tag of an encrypted segment (FORMAT.md
// section 15.4), which needs every frame header; the END header's CRC
// catches damage to it, and what a reader uses is authenticated by the
// manifest's MAC and each chunk's seal. A deduplicated checkpoint's packs
// hold other checkpoints' chunks too: `check` reads them (section 17.8).
func CheckSegments(ctx context.Context, a *ArchiveSource) error {
	m := a.man
	if m.SharedChunks || len(m.Segments) == 0 {
		return nil
	}
	walks := segmentWalks(a)
	errs := make([]error, len(walks))
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sem := make(chan struct{}, max(1, a.parallel))
	var wg sync.WaitGroup
	for i, w := range walks {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			if errs[i] = w.run(ctx); errs[i] != nil {
				cancel()
			}
		}()
	}
	wg.Wait()
	var first error
	for _, err := range errs {
		if err != nil && (first == nil || errors.Is(first, context.Canceled)) {
			first = err
		}
	}
	if first != nil {
		return first
	}
	for _, w := range walks[1:] {
		if w.id != walks[0].id {
			return w.corrupt(20, "stream header: stream id %016x, segment %s's %016x", w.id, walks[0].seg.Name, walks[0].id) // the id's offset
		}
	}
	return nil
}

// chunkRef is a chunk of a file of the manifest.
type chunkRef struct {
	f *manifest.File
	c manifest.Chunk
}

// segmentWalks sorts the manifest's chunks by segment: those whose frames
// fetch reads, in offset order, and the zero chunks, by offset.
func segmentWalks(a *ArchiveSource) []*segWalk {
	m := a.man
	walks := make([]*segWalk, len(m.Segments))
	for i, s := range m.Segments {
		walks[i] = &segWalk{a: a, seg: s, zeros: map[int64]chunkRef{}, names: map[uint32]string{}}
	}
	for fi := range m.Files {
		f := &m.Files[fi]
		for _, c := range f.Chunks {
			switch {
			case c.Segment < 0 || c.Segment >= len(walks): // a zero chunk without a frame
			case codec.ID(c.Codec) == codec.Zero:
				walks[c.Segment].zeros[c.Pos] = chunkRef{f, c}
			default:
				walks[c.Segment].listed = append(walks[c.Segment].listed, c)
			}
		}
	}
	for _, w := range walks {
		slices.SortFunc(w.listed, func(x, y manifest.Chunk) int { return int(x.Pos - y.Pos) })
	}
	return walks
}

// segWalk reads one segment's frames other than those fetch reads.
type segWalk struct {
	a      *ArchiveSource
	seg    manifest.Segment
	listed []manifest.Chunk   // frames fetch reads, by offset
	zeros  map[int64]chunkRef // zero chunks by offset, until found
	names  map[uint32]string  // files a FILE frame opened
	r      *bufio.Reader      // the segment from pos on
	pos    int64              // offset of r's next byte
	next   int                // the next of listed
	id     uint64             // the header's stream id
	ended  bool               // END and tail read
	buf    []byte             // payloads
	raw    []byte             // decoded chunks
}

// span is a stretch of a segment read in one request.
type span struct{ from, to int64 }

func (w *segWalk) run(ctx context.Context) error {
	info, err := w.a.chunks.Stat(ctx, w.seg.Name)
	if err != nil {
		return fmt.Errorf("%s: %w", w.a.chunks, err)
	}
	if info.Size != w.seg.Size {
		return w.corrupt(0, "%d bytes, the manifest says %d", info.Size, w.seg.Size)
	}
	reads, err := w.reads()
	if err != nil {
		return err
	}
	for _, sp := range reads {
		if err := w.read(ctx, sp); err != nil {
			return err
		}
	}
	if !w.ended {
		return w.corrupt(w.seg.Size, "the segment ends with a chunk's frame, not an END frame and tail")
	}
	if len(w.zeros) > 0 {
		pos := slices.Min(slices.Collect(maps.Keys(w.zeros)))
		return w.corrupt(pos, "the manifest places a zero chunk here, where no frame begins")
	}
	return nil
}

// reads are the stretches of the segment between the frames fetch reads,
// those close together read as one (coalesce).
func (w *segWalk) reads() ([]span, error) {
	var out []span
	add := func(from, to int64) {
		if n := len(out); n > 0 && from-out[n-1].to <= coalesce {
			out[n-1].to = to
			return
		}
		out = append(out, span{from, to})
	}
	at := int64(0)
	for _, c := range w.listed {
		if c.Pos < at {
			return nil, w.corrupt(c.Pos, "the manifest places a chunk's frame here, inside the frame before it")
		}
		if c.Pos > at {
			add(at, c.Pos)
		}
		at = c.Pos + manifest.FrameSize + int64(c.Stored)
	}
	if at < w.seg.Size {
		add(at, w.seg.Size)
	}
	if len(out) == 0 || out[0].from != 0 {
		return nil, w.corrupt(0, "the manifest places a chunk's frame where the stream header must be")
	}
	return out, nil
}

// read walks the frames of sp, passing over those fetch reads.
func (w *segWalk) read(ctx context.Context, sp span) error {
	for w.next < len(w.listed) && w.listed[w.next].Pos < sp.from {
		w.next++
	}
	rc, err := w.a.chunks.Open(ctx, w.seg.Name, sp.from, sp.to-sp.from)
	if err != nil {
		return fmt.Errorf("%s: %s at offset %d: %w", w.a.chunks, w.seg.Name, sp.from, err)
	}
	defer rc.Close()
	w.r, w.pos = bufio.NewReaderSize(rc, 32<<10), sp.from
	for w.pos < sp.to {
		if err := ctx.Err(); err != nil {
			return err
		}
		limit := w.seg.Size
		if w.next < len(w.listed) {
			c := w.listed[w.next]
			if c.Pos == w.pos {
				n := manifest.FrameSize + int64(c.Stored)
				if _, err := w.r.Discard(int(n)); err != nil {
					return w.short(w.pos, err)
				}
				w.pos += n
				w.next++
				continue
			}
			limit = c.Pos
		}
		if err := w.frame(limit); err != nil {
			return err
		}
	}
	return nil
}

// frame checks the frame at pos, which must end by limit: where the next
// frame fetch reads begins, or the segment's end.
func (w *segWalk) frame(limit int64) error {
	pos := w.pos
	if pos == 0 {
		return w.header(limit)
	}
	if w.ended {
		return w.corrupt(pos, "bytes after the tail")
	}
	fh, payload, err := w.frameAt(limit)
	if err != nil {
		return err
	}
	switch fh.Type {
	case manifest.FrameFile:
		name := string(payload)
		if !manifest.ValidName(name) {
			return w.corrupt(pos, "FILE frame with an unsafe name %s", manifest.PrintableName(name))
		}
		if old, ok := w.names[fh.FileID]; ok && old != name {
			return w.corrupt(pos, "file id %d, open as %s, opened again as %s", fh.FileID, manifest.PrintableName(old), manifest.PrintableName(name))
		}
		w.names[fh.FileID] = name
	case manifest.FrameData:
		return w.data(pos, fh, payload)
	case manifest.FrameFileEnd:
		if _, ok := w.names[fh.FileID]; !ok {
			return w.corrupt(pos, "FILE-END frame of file id %d, which no FILE frame opened", fh.FileID)
		}
		delete(w.names, fh.FileID)
	case manifest.FrameEnd:
		return w.end(pos)
	default:
		return w.corrupt(pos, "%s frame after the stream's first frame", fh.Type)
	}
	return nil
}

// header checks the stream header and, in an encrypted archive, the KEY
// frame after it against the manifest.
func (w *segWalk) header(limit int64) error {
	m := w.a.man
	if limit < manifest.HeaderSize {
		return w.corrupt(0, "a chunk's frame at %d, inside the stream header", limit)
	}
	var b [manifest.HeaderSize]byte
	if _, err := io.ReadFull(w.r, b[:]); err != nil {
		return w.short(0, err)
	}
	// A version this build does not know is damage too: the segment's
	// manifest is one it reads.
	h, err := manifest.UnmarshalHeader(b[:])
	encrypted := h.Version >= manifest.VersionEncrypted && h.Flags&manifest.HeaderFlagEncrypted != 0
	switch {
	case err != nil:
		return w.corrupt(0, "%w", err)
	case h.ShardIndex != 0 || h.ShardCount != 1:
		return w.corrupt(0, "stream header: shard %d of %d, where a segment is shard 0 of 1", h.ShardIndex, h.ShardCount)
	case h.Pack || h.LateData || h.NoChunkHashes != m.NoChunkHashes || encrypted != (m.Encryption != nil):
		return w.corrupt(0, "stream header: version %d, flags %#x, not those of the manifest's segments", h.Version, h.Flags)
	}
	w.id, w.pos = h.StreamID, manifest.HeaderSize
	e := m.Encryption
	if e == nil {
		return nil
	}
	fh, payload, err := w.frameAt(limit)
	if err != nil {
		return err
	}
	if fh.Type != manifest.FrameKey || fh.Codec != e.Cipher || fh.Offset != e.StreamID || fh.Hash != e.Salt ||
		!bytes.Equal(payload, e.KeyID[:]) || h.StreamID != e.StreamID {
		return w.corrupt(manifest.HeaderSize, "%s frame where the KEY frame of the manifest's key must be", fh.Type)
	}
	return nil
}

// frameAt reads the frame at pos, which must end by limit, and checks its
// header and, but for DATA, its payload's CRC-32C.
func (w *segWalk) frameAt(limit int64) (manifest.FrameHeader, []byte, error) {
	pos, m := w.pos, w.a.man
	var h [manifest.FrameSize]byte
	if pos+manifest.FrameSize > limit {
		return manifest.FrameHeader{}, nil, w.corrupt(pos, "%d bytes before %s: no room for a frame header", limit-pos, w.what(limit))
	}
	if _, err := io.ReadFull(w.r, h[:]); err != nil {
		return manifest.FrameHeader{}, nil, w.short(pos, err)
	}
	fh, err := manifest.UnmarshalFrameHeader(h[:])
	if err != nil {
		return fh, nil, w.corrupt(pos, "%w", err)
	}
	sealed := 0
	if m.Encryption != nil {
		sealed = crypt.Overhead
	}
	switch end := pos + manifest.FrameSize + int64(fh.StoredLen); {
	case end > limit:
		return fh, nil, w.corrupt(pos, "%s frame of %d payload bytes runs past %s", fh.Type, fh.StoredLen, w.what(limit))
	case fh.Type == manifest.FrameEnd && fh.StoredLen != 0:
		return fh, nil, w.corrupt(pos, "END frame of a segment with a payload of %d bytes", fh.StoredLen)
	case fh.Type == manifest.FrameData && (fh.RawLen == 0 || int(fh.RawLen) > m.ChunkSize ||
		int(fh.StoredLen) > codec.MaxEncodedLen(codec.ID(fh.Codec), m.ChunkSize)+sealed):
		return fh, nil, w.corrupt(pos, "DATA frame of %d bytes stored as %d, over the chunk size of %d", fh.RawLen, fh.StoredLen, m.ChunkSize)
	}
	w.buf = slices.Grow(w.buf[:0], int(fh.StoredLen))[:fh.StoredLen]
	if _, err := io.ReadFull(w.r, w.buf); err != nil {
		return fh, nil, w.short(pos+manifest.FrameSize, err)
	}
	if got := manifest.PayloadChecksum(w.buf); fh.Type != manifest.FrameData && got != fh.Checksum {
		return fh, nil, w.corrupt(pos, "%s frame payload checksum mismatch (stored %08x, computed %08x)", fh.Type, fh.Checksum, got)
	}
	w.pos += manifest.FrameSize + int64(fh.StoredLen)
	return fh, w.buf, nil
}

// data checks a DATA frame fetch does not read: a zero chunk of the
// manifest's, against its entry, or a chunk of a file written twice (the
// manifest lists the later copy), decoded as fetch would.
func (w *segWalk) data(pos int64, fh manifest.FrameHeader, payload []byte) error {
	a := w.a
	name, open := w.names[fh.FileID]
	if !open {
		return w.corrupt(pos, "DATA frame of file id %d, which no FILE frame opened", fh.FileID)
	}
	ref, listed := w.zeros[pos]
	if listed {
		delete(w.zeros, pos)
		if err := matchFrame(&fh, ref.f, &ref.c, a.man); err != nil {
			return w.corrupt(pos, "zero chunk of %s at file offset %d: %w", manifest.PrintableName(ref.f.Name), ref.c.Offset, err)
		}
		if name != ref.f.Name {
			return w.corrupt(pos, "zero chunk of %s in a frame of file id %d, %s", manifest.PrintableName(ref.f.Name), fh.FileID, manifest.PrintableName(name))
		}
	} else {
		// The entry the manifest would have for it, made of the header:
		// checked as any chunk, it is held to the rules of matchFrame's
		// that such an entry leaves: flags 0; sealed, a CRC-32C of 0 (it
		// travels inside the payload: FORMAT.md section 15.2); without
		// chunk hashes, a hash of 0 (section 5, DATA).
		ref = chunkRef{&manifest.File{ID: fh.FileID, Name: name}, manifest.Chunk{Offset: int64(fh.Offset), RawLen: fh.RawLen,
			Stored: fh.StoredLen, Codec: fh.Codec, Checksum: fh.Checksum, Hash: fh.Hash}}
		if a.man.Encryption != nil {
			ref.c.Checksum = 0
		}
		if a.man.NoChunkHashes {
			ref.c.Hash = [32]byte{}
		}
		if err := matchFrame(&fh, ref.f, &ref.c, a.man); err != nil {
			return w.corrupt(pos, "chunk of %s at file offset %d, which the manifest does not list: %w", manifest.PrintableName(name), fh.Offset, err)
		}
	}
	var hash [32]byte
	if codec.ID(fh.Codec) == codec.Zero {
		enc, sum, err := a.open(ref.f, ref.c, payload)
		crc, zero := a.sums.Zero(int(fh.RawLen))
		if err == nil && (len(enc) != 0 || sum != crc) {
			err = fmt.Errorf("zero chunk with a payload of %d bytes or the CRC-32C %08x", len(enc), sum)
		}
		if err != nil {
			return w.corrupt(pos, "%w", err)
		}
		hash = zero
	} else {
		w.raw = slices.Grow(w.raw[:0], int(fh.RawLen))[:fh.RawLen]
		if err := a.decode(w.raw, ref.f, ref.c, payload); err != nil {
			return w.corrupt(pos, "chunk of %s at file offset %d, which the manifest does not list: %w", manifest.PrintableName(name), fh.Offset, err)
		}
		hash = a.sums.Content(w.raw)
	}
	if a.opts.VerifyHashes && hash != ref.c.Hash {
		return w.corrupt(pos, "DATA frame: content hash mismatch")
	}
	return nil
}

// end checks the tail after the END frame at pos: it points at the frame
// and ends the segment.
func (w *segWalk) end(pos int64) error {
	if w.pos+manifest.TailSize != w.seg.Size {
		return w.corrupt(pos, "END frame with %d bytes after it, where only the %d of the tail may be", w.seg.Size-w.pos, manifest.TailSize)
	}
	var t [manifest.TailSize]byte
	if _, err := io.ReadFull(w.r, t[:]); err != nil {
		return w.short(w.pos, err)
	}
	if off, err := manifest.UnmarshalTail(t[:]); err != nil || off != uint64(pos) {
		return w.corrupt(w.pos, "the tail does not point at the END frame at %d", pos)
	}
	w.pos += manifest.TailSize
	w.ended = true
	return nil
}

// what names the place limit is, for messages.
func (w *segWalk) what(limit int64) string {
	if limit == w.seg.Size {
		return fmt.Sprintf("the segment's end at %d", limit)
	}
	return fmt.Sprintf("the chunk's frame at %d", limit)
}

// short is a read of the segment that ended early at pos.
func (w *segWalk) short(pos int64, err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return w.corrupt(pos, "the segment ends early: %v", err)
	}
	return fmt.Errorf("%s: %s at offset %d: %w", w.a.chunks, w.seg.Name, pos, err)
}

// corrupt is damage at pos of the segment: an error wrapping
// errdefs.ErrCorrupt.
func (w *segWalk) corrupt(pos int64, format string, args ...any) error {
	err := fmt.Errorf(format, args...)
	if !errors.Is(err, errdefs.ErrCorrupt) {
		err = fmt.Errorf("%w: %w", err, errdefs.ErrCorrupt)
	}
	return fmt.Errorf("%s: %s at offset %d: %w", w.a.chunks, w.seg.Name, pos, err)
}
