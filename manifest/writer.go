package manifest

import (
	"bufio"
	"crypto/sha256"
	"fmt"
	"hash"
	"io"
)

// Writer writes one stream: header, frames, END frame and tail. It is not
// safe for concurrent use; the pipeline's ordered writer owns it.
type Writer struct {
	w     *bufio.Writer
	under io.Writer // what w writes into
	pos   int64
	hdr   [FrameSize]byte
	// transcript and endTag: an encrypted stream's END frame authenticates
	// everything before it (EndTagInput).
	transcript hash.Hash
	endTag     func(input []byte) [32]byte
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
	hb := h.Marshal()
	if _, err := bw.Write(hb); err != nil {
		return nil, fmt.Errorf("write stream header: %w", err)
	}
	wr := &Writer{w: bw, under: w, pos: HeaderSize}
	if h.Encryption != nil {
		wr.transcript = sha256.New()
		wr.transcript.Write(hb)
	}
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
	pos, err := w.writeHeader(fh, len(payload), payload)
	if err != nil {
		return pos, err
	}
	if _, err := w.w.Write(payload); err != nil {
		return pos, fmt.Errorf("write %s frame payload at offset %d: %w", fh.Type, pos, err)
	}
	w.pos += FrameSize + int64(len(payload))
	return pos, nil
}

// writeHeader writes the header of a frame with an n-byte payload into the
// buffer; payload (of a frame other than DATA) is checksummed and
// transcribed, not written.
func (w *Writer) writeHeader(fh *FrameHeader, n int, payload []byte) (int64, error) {
	fh.StoredLen = uint32(n)
	if fh.Type != FrameData {
		fh.Checksum = PayloadChecksum(payload)
	}
	fh.Marshal(w.hdr[:])
	if w.transcript != nil && fh.Type != FrameEnd {
		w.transcript.Write(w.hdr[:])
		if fh.Type != FrameData {
			w.transcript.Write(payload)
		}
	}
	if _, err := w.w.Write(w.hdr[:]); err != nil {
		return w.pos, fmt.Errorf("write %s frame at offset %d: %w", fh.Type, w.pos, err)
	}
	return w.pos, nil
}

// Skipper is a writer under a Writer that can leave a range for others to
// fill: Skip moves the offset of its next byte n bytes on.
type Skipper interface {
	Skip(n int64) error
}

// WriteDataHeader writes the header of a DATA frame whose n-byte payload
// the caller writes: everything up to the header's end is flushed out, the
// Skipper given to NewWriter skips n bytes, and the caller writes the
// payload at the returned offset plus FrameSize by its own means (a
// positioned write). The stream's bytes, and an encrypted stream's END
// tag (which leaves DATA payloads out), are those WriteFrame would have
// produced.
func (w *Writer) WriteDataHeader(fh *FrameHeader, n int) (int64, error) {
	s, ok := w.under.(Skipper)
	if !ok || fh.Type != FrameData {
		return w.pos, fmt.Errorf("write %s frame header at offset %d: the payload can only be left out of a DATA frame on a writer that skips", fh.Type, w.pos)
	}
	pos, err := w.writeHeader(fh, n, nil)
	if err != nil {
		return pos, err
	}
	if err := w.w.Flush(); err != nil {
		return pos, fmt.Errorf("write %s frame at offset %d: %w", fh.Type, pos, err)
	}
	if err := s.Skip(int64(n)); err != nil {
		return pos, fmt.Errorf("skip %s frame payload at offset %d: %w", fh.Type, pos+FrameSize, err)
	}
	w.pos += FrameSize + int64(n)
	return pos, nil
}

// SetEndTag makes Finish write tag(EndTagInput(...)) into the END frame's
// hash: a MAC over the whole stream but its DATA payloads (which carry
// their own tags), so that no frame can be dropped, added, reordered or
// changed without the key. Only for an encrypted stream.
func (w *Writer) SetEndTag(tag func(input []byte) [32]byte) {
	if w.transcript != nil {
		w.endTag = tag
	}
}

// EndTagInput is what an encrypted stream's END tag authenticates: the
// SHA-256 of every byte from the stream header to the END frame, DATA
// payloads left out, then the SHA-256 of the END payload.
func EndTagInput(transcript, endPayload []byte) []byte {
	p := sha256.Sum256(endPayload)
	return append(append([]byte(nil), transcript...), p[:]...)
}

// Flush pushes buffered bytes to the underlying writer.
func (w *Writer) Flush() error { return w.w.Flush() }

// Finish writes the END frame carrying trailer (may be empty) and the tail,
// then flushes.
func (w *Writer) Finish(trailer []byte) error {
	end := FrameHeader{Type: FrameEnd}
	if w.endTag != nil {
		end.Hash = w.endTag(EndTagInput(w.transcript.Sum(nil), trailer))
	}
	pos, err := w.WriteFrame(&end, trailer)
	if err != nil {
		return err
	}
	if _, err := w.w.Write(MarshalTail(uint64(pos))); err != nil {
		return fmt.Errorf("write stream tail: %w", err)
	}
	w.pos += TailSize
	return w.w.Flush()
}
