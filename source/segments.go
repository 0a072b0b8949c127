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
//
// A manifest.Reader walks a segment's frames as a stream's, reading it
// through a segWalk, which fetches only those bytes and gives it each
// chunk's frame that fetch reads as fetch requires it to be: its header
// made of the manifest's entry, its payload (no END tag covers it) lent
// unread (manifest.PayloadLender).

import (
	"bufio"
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
	"github.com/gpucr/gpucr-stream/pipeline"
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
// (FILE: CRC-32C, a valid name, the same name for an id announced again;
// a zero chunk's DATA frame: against the manifest's entry, opened when
// sealed; another chunk's, of a file written twice: decoded and checked as
// any chunk; FILE-END: an open file, no payload), ending exactly where the
// next chunk's frame begins; each chunk's frame in a file open there (of
// its name; encrypted, of its id); the END frame with an empty payload,
// and the tail that points at it and ends the segment; encrypted, the END
// tag (FORMAT.md section 15.4), with the chunks' frame headers as the
// manifest has them (fetch checks them against it). A damaged byte is an
// error wrapping errdefs.ErrCorrupt that names the segment and the offset.
// A deduplicated checkpoint's packs hold other checkpoints' chunks too:
// `check` reads them (section 17.8).
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
		walks[i] = &segWalk{a: a, seg: s, zeros: map[int64]chunkRef{}, open: map[string]uint32{}}
	}
	for fi := range m.Files {
		f := &m.Files[fi]
		for _, c := range f.Chunks {
			switch {
			case c.Segment < 0 || c.Segment >= len(walks): // a zero chunk without a frame
			case codec.ID(c.Codec) == codec.Zero:
				walks[c.Segment].zeros[c.Pos] = chunkRef{f, c}
			default:
				walks[c.Segment].listed = append(walks[c.Segment].listed, chunkRef{f, c})
			}
		}
	}
	for _, w := range walks {
		slices.SortFunc(w.listed, func(x, y chunkRef) int { return int(x.c.Pos - y.c.Pos) })
	}
	return walks
}

// segWalk checks one segment's frames but those fetch reads, which rd
// walks reading the segment through it (Read, LendPayload).
type segWalk struct {
	a      *ArchiveSource
	ctx    context.Context
	seg    manifest.Segment
	listed []chunkRef         // frames fetch reads, by offset, until rd has read them
	zeros  map[int64]chunkRef // zero chunks by offset, until found
	open   map[string]uint32  // the id a FILE frame opened each name as
	rd     *manifest.Reader   // once it has read the header and KEY frame
	spans  []span             // what is left to read of the segment
	rc     io.ReadCloser      // spans[0], through br, at rpos
	br     *bufio.Reader
	rpos   int64
	pos    int64 // offset of the next byte rd reads
	err    error // the first error Read returned but io.EOF
	id     uint64
	buf    []byte // payloads
	raw    []byte // decoded chunks
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
	if w.spans, err = w.reads(); err != nil {
		return err
	}
	w.ctx, w.br = ctx, bufio.NewReaderSize(nil, 32<<10)
	defer w.close()
	rd, err := manifest.NewReader(w, "stream")
	if err != nil {
		return w.failed(0, err)
	}
	if err := w.header(rd.Header()); err != nil {
		return err
	}
	w.rd = rd
	rd.BorrowPayloads()
	if w.a.seal != nil {
		pipeline.CheckEnd(rd, w.a.seal)
	}
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		fr, err := rd.Next(w.alloc)
		if err != nil {
			return w.failed(rd.Pos(), err)
		}
		if fr.Type == manifest.FrameEnd {
			break
		}
		if err := w.frame(fr); err != nil {
			return err
		}
	}
	if rd.Pos() != w.seg.Size {
		return w.corrupt(rd.Pos(), "bytes after the tail")
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
	for _, r := range w.listed {
		if r.c.Pos < at {
			return nil, w.corrupt(r.c.Pos, "the manifest places a chunk's frame here, inside the frame before it")
		}
		if r.c.Pos > at {
			add(at, r.c.Pos)
		}
		at = r.c.Pos + manifest.FrameSize + int64(r.c.Stored)
	}
	if at < w.seg.Size {
		add(at, w.seg.Size)
	}
	if len(out) == 0 || out[0].from != 0 {
		return nil, w.corrupt(0, "the manifest places a chunk's frame where the stream header must be")
	}
	return out, nil
}

// header checks the stream header and KEY frame against the manifest.
func (w *segWalk) header(h manifest.Header) error {
	m := w.a.man
	switch {
	case h.ShardIndex != 0 || h.ShardCount != 1:
		return w.corrupt(0, "stream header: shard %d of %d, where a segment is shard 0 of 1", h.ShardIndex, h.ShardCount)
	case h.Pack || h.LateData || h.NoChunkHashes != m.NoChunkHashes || (h.Encryption != nil) != (m.Encryption != nil):
		return w.corrupt(0, "stream header: version %d, flags %#x, not those of the manifest's segments", h.Version, h.Flags)
	case h.Encryption != nil && *h.Encryption != *m.Encryption:
		return w.corrupt(manifest.HeaderSize, "KEY frame of a key other than the manifest's")
	}
	w.id = h.StreamID
	return nil
}

// frame checks what the Reader leaves to the archive of fr (not END): a
// FILE frame's name, the DATA frames fetch does not read.
func (w *segWalk) frame(fr manifest.Frame) error {
	switch fr.Type {
	case manifest.FrameFile:
		if !manifest.ValidName(fr.Name) {
			return w.corrupt(fr.Pos, "FILE frame with an unsafe name %s", manifest.PrintableName(fr.Name))
		}
		w.open[fr.Name] = fr.FileID
	case manifest.FrameFileEnd:
		if w.open[fr.Name] == fr.FileID {
			delete(w.open, fr.Name)
		}
	case manifest.FrameData:
		if !fr.Borrowed { // lent: a listed chunk's, which fetch checks
			return w.data(fr)
		}
	}
	return nil
}

// alloc is the payload buffer of a DATA frame fetch does not read.
func (w *segWalk) alloc(fh manifest.FrameHeader) ([]byte, error) {
	w.buf = slices.Grow(w.buf[:0], int(fh.StoredLen))[:fh.StoredLen]
	return w.buf, nil
}

// data checks a DATA frame fetch does not read: a zero chunk of the
// manifest's, against its entry, or a chunk of a file written twice (the
// manifest lists the later copy), decoded as fetch would.
func (w *segWalk) data(fr manifest.Frame) error {
	a, fh, pos, name := w.a, &fr.FrameHeader, fr.Pos, fr.Name
	ref, found := w.zeros[pos]
	if found {
		delete(w.zeros, pos)
		if err := matchFrame(fh, ref.f, &ref.c, a.man); err != nil {
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
		if err := matchFrame(fh, ref.f, &ref.c, a.man); err != nil {
			return w.corrupt(pos, "chunk of %s at file offset %d, which the manifest does not list: %w", manifest.PrintableName(name), fh.Offset, err)
		}
	}
	var hash [32]byte
	if codec.ID(fh.Codec) == codec.Zero {
		enc, sum, err := a.open(ref.f, ref.c, fr.Payload)
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
		if err := a.decode(w.raw, ref.f, ref.c, fr.Payload); err != nil {
			return w.corrupt(pos, "chunk of %s at file offset %d, which the manifest does not list: %w", manifest.PrintableName(name), fh.Offset, err)
		}
		hash = a.sums.Content(w.raw)
	}
	if a.opts.VerifyHashes && hash != ref.c.Hash {
		return w.corrupt(pos, "DATA frame: content hash mismatch")
	}
	return nil
}

// Read gives rd the next len(p) bytes of the segment, kept for failed if
// it fails: rd reads a header, a payload or the tail at a time
// (io.ReadFull), and one that runs into a listed frame (but its header,
// to rd beginning a frame there) or past the segment's end is damage.
func (w *segWalk) Read(p []byte) (int, error) {
	if w.err != nil {
		return 0, w.err
	}
	n, err := w.read(p)
	if err != nil && err != io.EOF {
		w.err, n = err, 0
	}
	return n, err
}

func (w *segWalk) read(p []byte) (int, error) {
	at, start, limit := w.pos, w.pos, w.seg.Size
	if w.rd != nil {
		start = w.rd.Pos() // the frame being read
	}
	if len(w.listed) > 0 {
		if r := w.listed[0]; at == r.c.Pos && start == at && len(p) == manifest.FrameSize {
			return w.listedHeader(p, r)
		}
		limit = w.listed[0].c.Pos
	}
	switch {
	case at == w.seg.Size:
		return 0, io.EOF
	case at+int64(len(p)) > limit:
		return 0, w.corrupt(start, "%d bytes at %d run past %s", len(p), at, w.what(limit))
	}
	err := w.seek()
	if err == nil {
		_, err = io.ReadFull(w.br, p)
	}
	if err != nil {
		return 0, w.short(at, err)
	}
	w.pos += int64(len(p))
	w.rpos = w.pos
	if start == at && len(p) == manifest.FrameSize {
		// A frame's header (before w.rd is set, the KEY frame's).
		return len(p), w.checkFrame(at, p, limit)
	}
	return len(p), nil
}

// checkFrame checks, before rd reads the payload, what an archive adds to
// the rules of the header hdr of the frame at pos (a damaged one is rd's
// to report): it ends by limit; an END frame's payload is empty; a DATA
// frame holds a chunk of the archive's chunk size.
func (w *segWalk) checkFrame(pos int64, hdr []byte, limit int64) error {
	m, sealed := w.a.man, 0
	if m.Encryption != nil {
		sealed = crypt.Overhead
	}
	switch fh, err := manifest.UnmarshalFrameHeader(hdr); {
	case err != nil:
	case pos+manifest.FrameSize+int64(fh.StoredLen) > limit:
		return w.corrupt(pos, "%s frame of %d payload bytes runs past %s", fh.Type, fh.StoredLen, w.what(limit))
	case fh.Type == manifest.FrameEnd && fh.StoredLen != 0:
		return w.corrupt(pos, "END frame of a segment with a payload of %d bytes", fh.StoredLen)
	case fh.Type == manifest.FrameData && (fh.RawLen == 0 || int(fh.RawLen) > m.ChunkSize ||
		int(fh.StoredLen) > codec.MaxEncodedLen(codec.ID(fh.Codec), m.ChunkSize)+sealed):
		return w.corrupt(pos, "DATA frame of %d bytes stored as %d, over the chunk size of %d", fh.RawLen, fh.StoredLen, m.ChunkSize)
	}
	return nil
}

// listedHeader gives the header of r's frame, which fetch reads, as fetch
// requires it to be: in a plain archive, whose manifest records no file
// ids (nor does fetch check them), of the id its file is open as.
func (w *segWalk) listedHeader(p []byte, r chunkRef) (int, error) {
	c, id := r.c, r.f.ID
	if w.a.man.Encryption == nil {
		var ok bool
		if id, ok = w.open[r.f.Name]; !ok {
			return 0, w.corrupt(c.Pos, "the manifest places a chunk of %s here, where no file of that name is open", manifest.PrintableName(r.f.Name))
		}
	}
	fh := manifest.FrameHeader{Type: manifest.FrameData, Codec: c.Codec, FileID: id, Offset: uint64(c.Offset),
		RawLen: c.RawLen, StoredLen: c.Stored, Checksum: c.Checksum, Hash: c.Hash}
	fh.Marshal(p)
	w.pos += manifest.FrameSize
	return manifest.FrameSize, nil
}

// LendPayload passes over the payload of the frame whose header
// listedHeader gave, lending rd an empty slice; it lends nothing else.
func (w *segWalk) LendPayload(n int) []byte {
	if len(w.listed) == 0 || w.pos != w.listed[0].c.Pos+manifest.FrameSize || n != int(w.listed[0].c.Stored) {
		return nil
	}
	w.pos += int64(n)
	w.listed = w.listed[1:]
	return []byte{}
}

// seek makes br read at pos, in the span that holds it: the spans hold
// every byte but the listed frames'.
func (w *segWalk) seek() error {
	for w.spans[0].to <= w.pos {
		w.close()
		w.spans = w.spans[1:]
	}
	if w.rc == nil {
		rc, err := w.a.chunks.Open(w.ctx, w.seg.Name, w.spans[0].from, w.spans[0].to-w.spans[0].from)
		if err != nil {
			return err
		}
		w.rc, w.rpos = rc, w.spans[0].from
		w.br.Reset(rc)
	}
	_, err := w.br.Discard(int(w.pos - w.rpos))
	return err
}

func (w *segWalk) close() {
	if w.rc != nil {
		w.rc.Close()
		w.rc = nil
	}
}

// failed is rd's error at pos: the one Read returned it, or damage (a
// version this build does not know too: the manifest's is one it reads).
func (w *segWalk) failed(pos int64, err error) error {
	if w.err != nil {
		return w.err
	}
	return w.corrupt(pos, "%w", err)
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
