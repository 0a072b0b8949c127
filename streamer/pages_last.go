package streamer

// Pages last: a stream in the order a restore reads it.
//
// CRIU's dump writes each process's page image (pages-N.img) before the
// small images, and inventory.img last; its restore asks for inventory.img
// first and the pages last. From a stream in dump order a restore waits for
// the whole stream before CRIU may start: through a pipe, the time to read
// every page. With Options.PagesLast the capture holds the non-zero chunks
// of the page images back, in an unlinked file, and writes them after
// every other frame, just before the END frame. Their FILE and FILE-END
// frames and their zero chunks go out in place, so a reader knows each page
// image's size, digest and zero pages (what sparse pages need to rewrite
// its pagemap) before the data comes; a reader that serves files as they
// arrive (source.StreamOptions.ServeEarly) lets CRIU restore from the first
// files while the pages are still on their way. The trade: the capture
// ends later, by the time to send what it held.
//
// The held frames are written in the order they were held, each placed
// then, so the stream's index (the trailer of a single-shard stream) says
// where each landed, as for any other frame.

import (
	"context"
	"fmt"
	"io"
	"os"
	"regexp"

	"github.com/gpucr/gpucr-stream/manifest"
)

// pagesImage matches CRIU's page images.
var pagesImage = regexp.MustCompile(`^pages-[0-9]+\.img$`)

// heldFrames are the DATA frames a capture holds back.
type heldFrames struct {
	f      *os.File // unlinked: gone with the capture, even after a crash
	end    int64
	frames []heldFrame
}

type heldFrame struct {
	fh    manifest.FrameHeader
	off   int64 // of its payload in f
	file  *fileState
	chunk int // its index in file.file.Chunks
}

// hold appends a DATA frame of fs to the held frames; its manifest chunk
// (index chunk) gets its place when it is written.
func (c *Capture) hold(fs *fileState, fh manifest.FrameHeader, payload []byte, chunk int) error {
	h := &c.held
	if h.f == nil {
		f, err := os.CreateTemp("", "gpucr-pages-last-*")
		if err != nil {
			return fmt.Errorf("hold page images back: %w", err)
		}
		os.Remove(f.Name())
		h.f = f
	}
	if _, err := h.f.WriteAt(payload, h.end); err != nil {
		return fmt.Errorf("hold %s at offset %d: %w", fs.file.Name, fh.Offset, err)
	}
	h.frames = append(h.frames, heldFrame{fh: fh, off: h.end, file: fs, chunk: chunk})
	h.end += int64(len(payload))
	return nil
}

// writeHeld writes the held frames, in the order they were held, and
// records where each landed in its file's manifest entry (whose chunks no
// longer grow: every file ended before this runs).
func (c *Capture) writeHeld(ctx context.Context) error {
	h := &c.held
	if h.f == nil {
		return nil
	}
	var buf []byte
	for _, hf := range h.frames {
		n := int(hf.fh.StoredLen)
		if cap(buf) < n {
			buf = make([]byte, n)
		}
		if _, err := h.f.ReadAt(buf[:n], hf.off); err != nil && err != io.EOF {
			return fmt.Errorf("write held %s at offset %d: %w", hf.file.file.Name, hf.fh.Offset, err)
		}
		fh := hf.fh
		loc, err := c.out.WriteFrame(ctx, &fh, buf[:n])
		if err != nil {
			return fmt.Errorf("write held %s at offset %d: %w", hf.file.file.Name, hf.fh.Offset, err)
		}
		ch := &hf.file.file.Chunks[hf.chunk]
		ch.Segment, ch.Pos = loc.Segment, loc.Pos
	}
	return nil
}

// closeHeld drops the held frames.
func (c *Capture) closeHeld() {
	if c.held.f != nil {
		c.held.f.Close()
		c.held = heldFrames{}
	}
}
