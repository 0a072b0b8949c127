package streamer

// Late data: a stream in the order a restore reads it.
//
// One concept, one word in code, "late". The flag --pages-last sets
// pipeline.Options.LateData; the capture then writes a stream of format 5
// (pipeline.Format.LateData) whose header flag manifest.HeaderFlagLateData
// says DATA frames may follow their file's FILE-END; a reader marks such a
// frame manifest.Frame.Late, and a stream source counts the shards that
// carried late data (lateShards) to learn that every file is announced.
// serve --early (source.StreamSourceOptions.ServeEarly, checkpoint's
// Early) is another concept: serving files while the stream still
// arrives. It works on any stream; late data is what lets CRIU start long
// before the end.
//
// CRIU's dump writes each process's page image (pages-N.img) before the
// small images, and inventory.img last; its restore asks for inventory.img
// first and the pages last. From a stream in dump order a restore waits for
// the whole stream before CRIU may start: through a pipe, the time to read
// every page. With Options.LateData the capture holds the non-zero chunks
// of the page images back and writes them late: after every other frame,
// just before the END frame. It keeps them in memory (a memfd) up to half
// the memory available, beyond that in an unlinked file in $TMPDIR: kept
// on a disk, the writes slowed CRIU's dump of a 1 GiB process 2x. Their
// FILE and FILE-END frames and their zero chunks go out in place, so a
// reader knows each page image's size, digest and zero pages (what sparse
// pages need to rewrite its pagemap) before the data comes; a reader that
// serves files as they arrive lets CRIU restore from the first files while
// the pages are still on their way. The trade: the capture ends later, by
// the time to send the late frames.
//
// The late frames are written in the order they were held back, each
// placed then, so the stream's index (the trailer of a single-shard
// stream) says where each landed, as for any other frame.

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"os"
	"regexp"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/proc"
)

// pagesImage matches CRIU's page images.
var pagesImage = regexp.MustCompile(`^pages-[0-9]+\.img$`)

// lateFrames are the DATA frames a capture holds back.
type lateFrames struct {
	// f is where they go now: a memfd up to memory bytes, then an
	// unlinked temporary file; both gone with the capture, even after a
	// crash. files are all opened so far.
	f        *os.File
	inMemory bool // f is the memfd
	files    []*os.File
	end      int64 // of f
	memory   int64
	frames   []lateFrame
}

type lateFrame struct {
	fh    manifest.FrameHeader
	f     *os.File
	off   int64 // of its payload in f
	file  *fileState
	chunk int // its index in file.file.Chunks
}

// lateInMemory is how much of the late frames a memfd takes: half the
// memory available, at least 1 GiB (what a stream source holds, too); a
// variable for the test that spills.
var lateInMemory = func() int64 { return max(1<<30, proc.AvailableMemory()/2) }

// addLate appends a DATA frame of fs to the late frames; its manifest chunk
// (index chunk) gets its place when it is written.
func (c *Capture) addLate(fs *fileState, fh manifest.FrameHeader, payload []byte, chunk int) error {
	h := &c.late
	if len(h.files) == 0 {
		h.memory = lateInMemory()
		if fd, err := unix.MemfdCreate("gpucr-pages-last", unix.MFD_CLOEXEC); err == nil {
			h.f, h.inMemory = os.NewFile(uintptr(fd), "memfd:gpucr-pages-last"), true
			h.files = append(h.files, h.f)
		}
	}
	if h.f == nil || h.inMemory && h.end+int64(len(payload)) > h.memory {
		f, err := os.CreateTemp("", "gpucr-pages-last-*")
		if err != nil {
			return fmt.Errorf("hold page images back: %w", err)
		}
		os.Remove(f.Name())
		h.f, h.inMemory, h.end = f, false, 0
		h.files = append(h.files, f)
	}
	if _, err := h.f.WriteAt(payload, h.end); err != nil {
		return fmt.Errorf("hold %s at offset %d: %w", fs.file.Name, fh.Offset, err)
	}
	h.frames = append(h.frames, lateFrame{fh: fh, f: h.f, off: h.end, file: fs, chunk: chunk})
	h.end += int64(len(payload))
	return nil
}

// writeLate writes the late frames, in the order they were held back, and
// records where each landed in its file's manifest entry (whose chunks no
// longer grow: every file ended before this runs). An asynchronous output
// writes a frame while the next ones are read back (lateBuffers of them).
func (c *Capture) writeLate(ctx context.Context) error {
	ao, async := c.out.(AsyncOutput)
	bufs := make(chan []byte, lateBuffers)
	for range lateBuffers {
		bufs <- nil
	}
	var failed error
	var failMu sync.Mutex
	for _, hf := range c.late.frames {
		var buf []byte
		select {
		case buf = <-bufs:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		n := int(hf.fh.StoredLen)
		if cap(buf) < n {
			buf = make([]byte, n)
		}
		buf = buf[:n]
		what := func(err error) error {
			return fmt.Errorf("write held %s at offset %d: %w", hf.file.file.Name, hf.fh.Offset, err)
		}
		if _, err := hf.f.ReadAt(buf, hf.off); err != nil && err != io.EOF {
			return what(err)
		}
		fh := hf.fh
		var loc FramePos
		var err error
		if async {
			loc, err = ao.WriteFrameAsync(ctx, &fh, buf, func(err error) {
				if err != nil {
					failMu.Lock()
					failed = cmp.Or(failed, what(err))
					failMu.Unlock()
				}
				bufs <- buf
			})
		} else {
			loc, err = c.out.WriteFrame(ctx, &fh, buf)
			bufs <- buf
		}
		if err != nil {
			return what(err)
		}
		ch := &hf.file.file.Chunks[hf.chunk]
		ch.Segment, ch.Pos = loc.Segment, loc.Pos
	}
	// Every buffer back: every write done.
	for range lateBuffers {
		<-bufs
	}
	failMu.Lock()
	defer failMu.Unlock()
	return failed
}

// lateBuffers is how many late frames are read back ahead of their write.
const lateBuffers = 4

// closeLate drops the late frames (files stays, closed, to say where they
// were).
func (c *Capture) closeLate() {
	for _, f := range c.late.files {
		f.Close()
	}
	c.late.f, c.late.frames = nil, nil
}
