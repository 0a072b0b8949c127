package manifest

import (
	"bufio"
	"fmt"
	"io"
)

// Writer writes one stream: header, frames, END frame and tail. It is not
// safe for concurrent use; the pipeline's ordered writer owns it.
type Writer struct {
	w   *bufio.Writer
	pos int64
	hdr [FrameSize]byte
}

// NewWriter writes the stream header to w.
func NewWriter(w io.Writer, h Header) (*Writer, error) {
	h.Version = VersionPlain
	if h.Encryption != nil {
		h.Version = VersionEncrypted
		h.Flags |= HeaderFlagEncrypted
		h.StreamID = h.Encryption.StreamID
	}
	if h.ShardCount == 0 {
		h.ShardCount = 1
	}
	// Large payloads bypass the buffer; it only gathers headers and small frames.
	bw := bufio.NewWriterSize(w, 256<<10)
	if _, err := bw.Write(h.Marshal()); err != nil {
		return nil, fmt.Errorf("write stream header: %w", err)
	}
	wr := &Writer{w: bw, pos: HeaderSize}
	if h.Encryption != nil {
		fh, payload := h.Encryption.keyFrame()
		if _, err := wr.WriteFrame(&fh, payload); err != nil {
			return nil, err
		}
	}
	return wr, nil
}

// Pos is the offset at which the next frame will start.
func (w *Writer) Pos() int64 { return w.pos }

// WriteFrame writes a frame and returns the offset of its header. For
// frames other than DATA it fills in StoredLen and the payload checksum.
func (w *Writer) WriteFrame(fh *FrameHeader, payload []byte) (int64, error) {
	fh.StoredLen = uint32(len(payload))
	if fh.Type != FrameData {
		fh.Checksum = PayloadChecksum(payload)
	}
	fh.Marshal(w.hdr[:])
	pos := w.pos
	if _, err := w.w.Write(w.hdr[:]); err != nil {
		return pos, fmt.Errorf("write %s frame at offset %d: %w", fh.Type, pos, err)
	}
	if _, err := w.w.Write(payload); err != nil {
		return pos, fmt.Errorf("write %s frame payload at offset %d: %w", fh.Type, pos, err)
	}
	w.pos += FrameSize + int64(len(payload))
	return pos, nil
}

// Flush pushes buffered bytes to the underlying writer.
func (w *Writer) Flush() error { return w.w.Flush() }

// Finish writes the END frame carrying trailer (may be empty) and the tail,
// then flushes.
func (w *Writer) Finish(trailer []byte) error {
	pos, err := w.WriteFrame(&FrameHeader{Type: FrameEnd}, trailer)
	if err != nil {
		return err
	}
	if _, err := w.w.Write(MarshalTail(uint64(pos))); err != nil {
		return fmt.Errorf("write stream tail: %w", err)
	}
	w.pos += TailSize
	return w.w.Flush()
}
