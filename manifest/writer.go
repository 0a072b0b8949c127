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
	under io.Writer
	pos   int64
	hdr   [FrameSize]byte
	// transcript and endTag: an encrypted stream's END frame authenticates
	// everything before it (EndTagInput).
	transcript hash.Hash
	endTag     func(input []byte) [32]byte
}

// NewWriter writes the stream header to w: h's version and flags follow
// from its Encryption and NoChunkHashes (VersionOf).
func NewWriter(w io.Writer, h Header) (*Writer, error) {
	h.Version = VersionOf(h.Encryption != nil, h.NoChunkHashes)
	if h.Pack {
		if h.Encryption != nil || h.NoChunkHashes {
			return nil, fmt.Errorf("write pack header: a pack's chunks are plain and named by their hash")
		}
		h.Version = VersionSharedChunks
		h.Flags |= HeaderFlagPack
	}
	if h.LateData {
		if h.Pack {
			return nil, fmt.Errorf("write stream header: a pack has no files")
		}
		h.Version = VersionLateData
		h.Flags |= HeaderFlagLateData
	}
	if h.Encryption != nil {
		h.Flags |= HeaderFlagEncrypted
		h.StreamID = h.Encryption.StreamID
	} else if h.NoChunkHashes {
		h.Flags |= HeaderFlagNoChunkHashes
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
	fh.StoredLen = uint32(len(payload))
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

// RefWriter is a shard writer that can send a DATA frame by reference:
// hdr is the frame's header, and the peer holds its payload (the live
// migration's pre-copy, transport/tcp).
type RefWriter interface {
	WriteRef(hdr []byte) error
}

// WriteRef writes the DATA frame fh, whose StoredLen payload bytes the
// reader already holds, by reference, through the underlying RefWriter;
// it advances the position as the whole frame would. Not for an
// encrypted stream (its transcript and tags cover what is written).
func (w *Writer) WriteRef(fh *FrameHeader) (int64, error) {
	rw, ok := w.under.(RefWriter)
	if !ok || w.transcript != nil || fh.Type != FrameData {
		return w.pos, fmt.Errorf("write frame at offset %d by reference: not possible on this stream", w.pos)
	}
	fh.Marshal(w.hdr[:])
	pos := w.pos
	if err := w.w.Flush(); err != nil {
		return pos, fmt.Errorf("write DATA frame at offset %d: %w", pos, err)
	}
	if err := rw.WriteRef(w.hdr[:]); err != nil {
		return pos, fmt.Errorf("write DATA frame at offset %d by reference: %w", pos, err)
	}
	w.pos += FrameSize + int64(fh.StoredLen)
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
