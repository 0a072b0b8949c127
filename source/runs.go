package source

// A deduplicated checkpoint (format 4) cuts files by content into chunks of
// about a tenth of chunk_size, and a read per chunk would cost ten times
// the requests of a plain archive (a ranged GET each on S3). Consecutive
// chunks of a file that lie one after the other in a pack, as a capture
// writes a file's new chunks, are read as one run of up to chunk_size raw
// bytes: one request for their frames (stepping over a few of another
// file's, runsOf; a second where the run goes on in another pack), into
// one page buffer of frames. Each frame is checked there; a chunk stored
// raw is written out from there (spliced, like a plain archive's chunk,
// which is read into its page buffer), an encoded one decoded into a
// second page buffer of the run's raw size. Read-ahead and memory are
// counted as for one chunk (and twice its size of frames read). A store
// whose reader reads at offsets (a directory) reads only the run's frames,
// not the others between.

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
)

// run is chunks first..first+n-1 of a file, raw bytes in all, read in
// two pieces when split > 0: chunks first..first+split-1 and the rest.
type run struct {
	first, n int
	raw      int64
	split    int
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
// less than a request per chunk (BenchmarkRestoreDedupFiles). It may go on
// once elsewhere, in a second piece (a second request): a pack ends
// anywhere in a file's chunks, and a run cut there would be two smaller
// buffers, each mapped and zeroed to whole huge pages.
func runsOf(f *manifest.File, maxRaw, maxSpan, maxGap int64) []run {
	var out []run
	var span int64 // of the last run
	for i, c := range f.Chunks {
		frame := manifest.FrameSize + int64(c.Stored)
		if k := len(out) - 1; k >= 0 && codec.ID(c.Codec) != codec.Zero {
			r := &out[k]
			prev := f.Chunks[r.first+r.n-1]
			gap := c.Pos - (prev.Pos + manifest.FrameSize + int64(prev.Stored))
			next := prev.Segment == c.Segment && gap >= 0 && gap <= maxGap
			if !next {
				gap = 0 // a second piece, read on its own
			}
			if codec.ID(prev.Codec) != codec.Zero && (next || r.split == 0) &&
				r.raw+int64(c.RawLen) <= maxRaw && span+gap+frame <= maxSpan {
				if !next {
					r.split = r.n
				}
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
// read into a page buffer (pooled; spliceable like a plain chunk's), with
// a request for each of its pieces; a chunk stored raw is checked where it lies there and written
// from there, and only encoded chunks are decoded, into a second page
// buffer of the run's raw size. So no byte is copied that a plain
// archive's restore would not copy.
func (a *ArchiveSource) fetchRun(ctx context.Context, f *manifest.File, r run) (fetched, error) {
	if r.n == 1 {
		return a.fetch(ctx, f, r.first)
	}
	cs := f.Chunks[r.first : r.first+r.n]
	where := func(c manifest.Chunk, format string, args ...any) error {
		return fmt.Errorf("%s: %s at offset %d (file %s, chunk at file offset %d): %w", a.chunks, a.man.Segments[c.Segment].Name, c.Pos, f.Name, c.Offset, fmt.Errorf(format, args...))
	}
	pieces := [][]manifest.Chunk{cs}
	if r.split > 0 {
		pieces = [][]manifest.Chunk{cs[:r.split], cs[r.split:]}
	}
	var size int64
	for _, p := range pieces {
		size += spanOf(p)
	}
	frames, err := a.frames.get(int(size))
	if err != nil {
		return fetched{}, where(cs[0], "%w", err)
	}
	v := fetched{frames: frames, raw: make([][]byte, 0, r.n)}
	fail := func(err error) (fetched, error) {
		a.drop(v)
		return fetched{}, err
	}
	// The pieces one after another in buf, and each frame's place there.
	buf := frames.b
	pos := make([]int64, 0, len(cs))
	var used int64
	for _, p := range pieces {
		if pos, used, err = a.readPiece(ctx, p, buf, used, pos); err != nil {
			return fail(where(p[0], "read frames: %w", err))
		}
	}
	var off, stored int64 // off: in v.page, of the next encoded chunk
	for k, c := range cs {
		at := pos[k]
		fh, err := manifest.UnmarshalFrameHeader(buf[at : at+manifest.FrameSize])
		if err != nil {
			return fail(where(c, "%w: %w", err, errdefs.ErrCorrupt))
		}
		if err := matchFrame(&fh, f, &c, a.man); err != nil {
			return fail(where(c, "%w", err))
		}
		enc, sum, err := a.open(f, c, buf[at+manifest.FrameSize:at+manifest.FrameSize+int64(c.Stored)])
		if err != nil {
			return fail(where(c, "%w", err))
		}
		raw := enc // stored raw: checked in place
		if codec.ID(c.Codec) == codec.None {
			if len(enc) != int(c.RawLen) {
				return fail(where(c, "raw chunk stores %d bytes for %d: %w", len(enc), c.RawLen, errdefs.ErrCorrupt))
			}
			v.inPlace = true
		} else {
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

// spanOf is the bytes from the first of cs's frames to the end of the last.
func spanOf(cs []manifest.Chunk) int64 {
	last := cs[len(cs)-1]
	return last.Pos + manifest.FrameSize + int64(last.Stored) - cs[0].Pos
}

// readPiece reads the frames of cs, which lie in this order in one pack,
// into buf from at, and appends each one's place in buf to pos; it returns
// where in buf the next piece goes. A reader at offsets (a local file)
// reads only them, stepping over other frames between, one after another:
// only the pages they need are touched. Others read the whole span, each
// frame at its place.
func (a *ArchiveSource) readPiece(ctx context.Context, cs []manifest.Chunk, buf []byte, at int64, pos []int64) ([]int64, int64, error) {
	base, span := cs[0].Pos, spanOf(cs)
	rd, err := a.chunks.Open(ctx, a.man.Segments[cs[0].Segment].Name, base, span)
	if err != nil {
		return pos, at, err
	}
	defer rd.Close()
	ra, ok := rd.(io.ReaderAt)
	if !ok {
		if _, err := io.ReadFull(rd, buf[at:at+span]); err != nil {
			return pos, at, eofCorrupt(err)
		}
		for _, c := range cs {
			pos = append(pos, at+c.Pos-base)
		}
		return pos, at + span, nil
	}
	for i := 0; i < len(cs); {
		start, n := cs[i].Pos-base, int64(0)
		for ; i < len(cs) && cs[i].Pos-base == start+n; i++ {
			pos = append(pos, at+n)
			n += manifest.FrameSize + int64(cs[i].Stored)
		}
		if k, err := ra.ReadAt(buf[at:at+n], start); k < int(n) {
			if err == nil {
				err = io.ErrUnexpectedEOF
			}
			return pos, at, eofCorrupt(err)
		}
		at += n
	}
	return pos, at, nil
}

// eofCorrupt marks a read cut short: the store holds less than the index
// says, damage.
func eofCorrupt(err error) error {
	if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		return fmt.Errorf("%w: %w", err, errdefs.ErrCorrupt)
	}
	return err
}
