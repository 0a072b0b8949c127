package source

// A deduplicated checkpoint (format 4) cuts files by content into chunks of
// about a tenth of chunk_size, and a read per chunk would cost ten times
// the requests of a plain archive (a ranged GET each on S3). Consecutive
// chunks of a file that lie one after the other in one pack, as a capture
// writes a file's new chunks, are read as one run: one request for their
// frames (stepping over a few of another file's, runsOf), each frame
// checked and decoded into its place in one page buffer of at most the
// largest chunk's size, so that read-ahead and memory are counted as for
// one chunk (and twice its size of frames read).

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
)

// run is chunks first..first+n-1 of a file, raw bytes in all.
type run struct {
	first, n int
	raw      int64
}

// runSpan is the most bytes a run reads: its payloads, as many as its raw
// bytes (a codec never stores a chunk larger), a frame header per 64 KiB,
// and as much again of other frames it steps over.
func runSpan(maxRaw int64) int64 { return 2 * (maxRaw + maxRaw/1024 + manifest.FrameSize) }

// runGap is the most bytes of other frames a run steps over at once.
func runGap(maxRaw int64) int64 { return maxRaw / 2 }

// runsOf groups f's chunks into runs of at most maxRaw raw bytes and
// maxSpan bytes read; a zero chunk is a run of its own. A run may step
// over at most maxGap bytes of other frames between two of its chunks:
// where more files were captured at once than packs were written, two
// files' chunks alternate in a pack, and reading the other's too costs
// less than a request per chunk (BenchmarkRestoreDedupFiles).
func runsOf(f *manifest.File, maxRaw, maxSpan, maxGap int64) []run {
	var out []run
	var span int64 // of the last run
	for i, c := range f.Chunks {
		frame := manifest.FrameSize + int64(c.Stored)
		if k := len(out) - 1; k >= 0 && codec.ID(c.Codec) != codec.Zero {
			r := &out[k]
			prev := f.Chunks[r.first+r.n-1]
			gap := c.Pos - (prev.Pos + manifest.FrameSize + int64(prev.Stored))
			if codec.ID(prev.Codec) != codec.Zero && prev.Segment == c.Segment &&
				gap >= 0 && gap <= maxGap &&
				r.raw+int64(c.RawLen) <= maxRaw && span+gap+frame <= maxSpan {
				r.n++
				r.raw += int64(c.RawLen)
				span += gap + frame
				continue
			}
		}
		out = append(out, run{first: i, n: 1, raw: int64(c.RawLen)})
		span = frame
	}
	return out
}

// fetchRun reads and decodes one run of f's chunks. The run's frames are
// read at once into a page buffer (pooled; spliceable like a plain
// chunk's); a chunk stored raw is checked where it lies there and written
// from there, and only encoded chunks are decoded, into a second page
// buffer of the run's raw size. So no byte is copied that a plain
// archive's restore would not copy.
func (a *ArchiveSource) fetchRun(ctx context.Context, f *manifest.File, r run) (fetched, error) {
	if r.n == 1 {
		return a.fetch(ctx, f, r.first)
	}
	cs := f.Chunks[r.first : r.first+r.n]
	first, last := cs[0], cs[len(cs)-1]
	seg := a.man.Segments[first.Segment].Name
	where := func(c manifest.Chunk, format string, args ...any) error {
		return fmt.Errorf("%s: %s at offset %d (file %s, chunk at file offset %d): %w", a.chunks, seg, c.Pos, f.Name, c.Offset, fmt.Errorf(format, args...))
	}
	span := last.Pos + manifest.FrameSize + int64(last.Stored) - first.Pos
	frames, err := a.frames.get(int(span))
	if err != nil {
		return fetched{}, where(first, "%w", err)
	}
	v := fetched{frames: frames, raw: make([][]byte, 0, r.n)}
	fail := func(err error) (fetched, error) {
		a.drop(v)
		return fetched{}, err
	}
	buf := frames.b[:span]
	rd, err := a.chunks.Open(ctx, seg, first.Pos, span)
	if err != nil {
		return fail(where(first, "%w", err))
	}
	packed, err := readFrames(rd, buf, cs)
	rd.Close()
	if err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			err = fmt.Errorf("%w: %w", err, errdefs.ErrCorrupt)
		}
		return fail(where(first, "read frames: %w", err))
	}
	var at, off, stored int64 // at: c's frame in buf; off: in v.page, of the next encoded chunk
	for _, c := range cs {
		if !packed {
			at = c.Pos - first.Pos
		}
		fh, err := manifest.UnmarshalFrameHeader(buf[at : at+manifest.FrameSize])
		if err != nil {
			return fail(where(c, "%w: %w", err, errdefs.ErrCorrupt))
		}
		if fh.Type != manifest.FrameData || fh.Offset != 0 || fh.FileID != 0 || fh.RawLen != c.RawLen ||
			fh.StoredLen != c.Stored || fh.Codec != c.Codec || fh.Checksum != c.Checksum || fh.Hash != c.Hash {
			return fail(where(c, "frame does not match the index: %w", errdefs.ErrCorrupt))
		}
		enc, sum, err := a.open(f, c, buf[at+manifest.FrameSize:at+manifest.FrameSize+int64(c.Stored)])
		if err != nil {
			return fail(where(c, "%w", err))
		}
		raw := enc // stored raw: checked in place
		if codec.ID(c.Codec) == codec.None && len(enc) != int(c.RawLen) {
			return fail(where(c, "raw chunk stores %d bytes for %d: %w", len(enc), c.RawLen, errdefs.ErrCorrupt))
		} else if codec.ID(c.Codec) != codec.None {
			if v.page == nil {
				if v.page, err = a.pages.get(int(r.raw)); err != nil {
					return fail(where(c, "%w", err))
				}
			}
			raw = v.page.b[off : off+int64(c.RawLen)]
			off += int64(c.RawLen)
		}
		if err := decodeChunk(raw, c.Codec, sum, enc); err != nil {
			return fail(where(c, "%w", err))
		}
		if a.opts.VerifyHashes && a.sums.Content(raw) != c.Hash {
			return fail(where(c, "content hash mismatch: %w", errdefs.ErrCorrupt))
		}
		v.raw = appendAdjacent(v.raw, raw)
		stored += int64(c.Stored)
		at += manifest.FrameSize + int64(c.Stored)
	}
	a.Counters.StoredBytes.Add(stored)
	a.Counters.StoredRaw.Add(r.raw)
	return v, nil
}

// appendAdjacent appends b to bs, joining it to the last piece when it
// follows that piece in memory (chunks decoded one after another).
func appendAdjacent(bs [][]byte, b []byte) [][]byte {
	if k := len(bs) - 1; k >= 0 && len(b) > 0 {
		if last := bs[k]; cap(last) >= len(last)+len(b) && addr(last)+uintptr(len(last)) == addr(b) {
			bs[k] = last[:len(last)+len(b)]
			return bs
		}
	}
	return append(bs, b)
}

// readFrames reads the frames of cs into buf. A reader at offsets (a
// local file) reads only them, stepping over other frames between, one
// after another from buf's start (packed): only the pages they need are
// touched. Others read the whole span, each frame at its place.
func readFrames(rd io.Reader, buf []byte, cs []manifest.Chunk) (packed bool, err error) {
	ra, ok := rd.(io.ReaderAt)
	if !ok {
		_, err := io.ReadFull(rd, buf)
		return false, err
	}
	base, at := cs[0].Pos, int64(0)
	for i := 0; i < len(cs); {
		start, n := cs[i].Pos-base, manifest.FrameSize+int64(cs[i].Stored)
		for i++; i < len(cs) && cs[i].Pos-base == start+n; i++ {
			n += manifest.FrameSize + int64(cs[i].Stored)
		}
		if k, err := ra.ReadAt(buf[at:at+n], start); k < int(n) {
			if err == nil || err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return true, err
		}
		at += n
	}
	return true, nil
}
