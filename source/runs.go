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

// fetchRun reads and decodes one run of f's chunks.
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
	page, err := a.pages.get(int(r.raw))
	if err != nil {
		return fetched{}, where(first, "%w", err)
	}
	span := last.Pos + manifest.FrameSize + int64(last.Stored) - first.Pos
	v := fetched{page: page, payload: a.payloadBuf(int(span))}
	fail := func(err error) (fetched, error) {
		a.drop(v)
		return fetched{}, err
	}
	buf := *v.payload
	rd, err := a.chunks.Open(ctx, seg, first.Pos, span)
	if err != nil {
		return fail(where(first, "%w", err))
	}
	_, err = io.ReadFull(rd, buf)
	rd.Close()
	if err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			err = fmt.Errorf("%w: %w", err, errdefs.ErrCorrupt)
		}
		return fail(where(first, "read frames: %w", err))
	}
	var off int64
	for _, c := range cs {
		at := c.Pos - first.Pos
		fh, err := manifest.UnmarshalFrameHeader(buf[at : at+manifest.FrameSize])
		if err != nil {
			return fail(where(c, "%w: %w", err, errdefs.ErrCorrupt))
		}
		if fh.Type != manifest.FrameData || fh.Offset != 0 || fh.FileID != 0 || fh.RawLen != c.RawLen ||
			fh.StoredLen != c.Stored || fh.Codec != c.Codec || fh.Checksum != c.Checksum || fh.Hash != c.Hash {
			return fail(where(c, "frame does not match the index: %w", errdefs.ErrCorrupt))
		}
		raw := page.b[off : off+int64(c.RawLen)]
		payload := buf[at+manifest.FrameSize : at+manifest.FrameSize+int64(c.Stored)]
		if err := a.decode(raw, f, c, payload); err != nil {
			return fail(where(c, "%w", err))
		}
		if a.opts.VerifyHashes && a.sums.Content(raw) != c.Hash {
			return fail(where(c, "content hash mismatch: %w", errdefs.ErrCorrupt))
		}
		off += int64(c.RawLen)
		a.Counters.StoredBytes.Add(int64(c.Stored))
	}
	v.raw = page.b[:r.raw]
	return v, nil
}
