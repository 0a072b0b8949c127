package tcp

// The sender's side of pre-copy (wire/chunk.go): chunks sent ahead of the
// stream with SendChunk, and the stream's DATA frames of those chunks sent
// as REF records. The receiver holds every chunk sent ahead until the
// stream is read (its cache has no eviction), so a chunk sent is a chunk
// it holds, or the whole transfer fails.

import (
	"context"
	"encoding/binary"
	"errors"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/transport/tcp/wire"
)

// refChunk is what the receiver holds of a chunk sent ahead.
type refChunk struct {
	codec    uint8
	raw, crc uint32
	stored   uint32
}

// SendChunk sends one chunk ahead of the stream (the receiver must have
// announced ReceiverInfo.ChunkCache), on the connections in turn; stored
// may be reused once it returns. Chunks the receiver holds already are
// not sent again.
func (t *Output) SendChunk(ctx context.Context, c wire.Chunk) error {
	if !t.info.ChunkCache {
		return errors.New("the receiver keeps no chunk cache (an older gpucr-stream)")
	}
	if err := t.Err(); err != nil {
		return err
	}
	t.refMu.Lock()
	if _, ok := t.refs[c.ID]; ok {
		t.refMu.Unlock()
		return nil
	}
	conn := t.conns[t.nextChunk%len(t.conns)]
	t.nextChunk++
	t.refMu.Unlock()
	p := append(wire.MarshalChunkHeader(c), c.Stored...)
	select {
	case conn.queue <- sendItem{typ: wire.RecChunk, buf: p}:
	case <-t.failed:
		return t.err
	case <-ctx.Done():
		return context.Cause(ctx)
	}
	t.refMu.Lock()
	if t.refs == nil {
		t.refs = map[[32]byte]refChunk{}
	}
	t.refs[c.ID] = refChunk{codec: c.Codec, raw: c.RawLen, crc: c.CRC, stored: uint32(len(c.Stored))}
	t.refMu.Unlock()
	return nil
}

// KeepAlive sends an empty DATA record on every connection that has
// nothing queued: during pre-copy rounds that send nothing for a while
// the receiver must not take the silence for a dead link.
func (t *Output) KeepAlive() {
	for _, c := range t.conns {
		select {
		case c.queue <- sendItem{typ: wire.RecData}:
		default: // full: it is sending anyway
		}
	}
}

// PeerHas says the receiver has chunk id (sent ahead).
func (t *Output) PeerHas(id [32]byte) bool {
	t.refMu.Lock()
	defer t.refMu.Unlock()
	_, ok := t.refs[id]
	return ok
}

// refFrame says whether DATA frame fh goes by reference, and makes its
// header the one of the chunk the receiver has: a frame the capture did
// not encode (RefOutput.Knows said the receiver has it), or stored raw
// for a copy beside this output, takes the receiver's chunk's codec and
// length; an encoded one goes by reference only if it is encoded as the
// receiver's one.
func (t *Output) refFrame(fh *manifest.FrameHeader, payload []byte) (streamer.FramePos, bool) {
	if fh.Type != manifest.FrameData || codec.ID(fh.Codec) == codec.Zero || fh.RawLen == 0 {
		return streamer.FramePos{}, false
	}
	t.refMu.Lock()
	r, ok := t.refs[fh.Hash]
	t.refMu.Unlock()
	if !ok || r.raw != fh.RawLen || r.crc != fh.Checksum {
		return streamer.FramePos{}, false
	}
	switch {
	case len(payload) == 0 && fh.StoredLen == 0 && codec.ID(fh.Codec) == codec.None:
		fh.Codec, fh.StoredLen = r.codec, r.stored
		return streamer.FramePos{Ref: true, Codec: r.codec, Stored: r.stored}, true
	case fh.Codec == r.codec && fh.StoredLen == r.stored:
		return streamer.FramePos{}, true
	case codec.ID(fh.Codec) == codec.None && fh.StoredLen == fh.RawLen:
		// Stored raw for a local copy beside this output (a tee): the
		// receiver's frame is its own chunk, as it was encoded.
		fh.Codec, fh.StoredLen = r.codec, r.stored
		return streamer.FramePos{}, true
	}
	return streamer.FramePos{}, false
}

// RefBytes are the stored bytes the stream sent by reference.
func (t *Output) RefBytes() int64 { return t.refBytes.Load() }

// WriteRef implements manifest.RefWriter: a REF record in the shard's
// place of the frame.
func (c *sendConn) WriteRef(hdr []byte) error {
	if err := c.push(); err != nil {
		return err
	}
	select {
	case c.queue <- sendItem{typ: wire.RecRef, buf: wire.MarshalRef(hdr)}:
		c.o.refBytes.Add(int64(binary.LittleEndian.Uint32(hdr[20:]))) // the frame's stored length
		return nil
	case <-c.o.failed:
		return c.o.err
	}
}

// RefOutput is t for a capture whose chunks are cut by content (so that
// they meet the chunks sent ahead) and, with Skip, not encoded where the
// receiver has them (nothing else needs their bytes: no local copy).
type RefOutput struct {
	*Output
	Skip bool
}

// Knows implements the capture's dedup test (streamer's knower).
func (r RefOutput) Knows(id [32]byte) bool { return r.Skip && r.PeerHas(id) }

// AheadOutput is a capture's output that sends the chunks the receiver
// does not hold ahead of the stream (SendChunk), and writes nothing else:
// a pre-copy round, whose files and manifest are not needed (the final
// stream names every file). Chunks counts the chunks it sent, Sent their
// stored bytes.
type AheadOutput struct {
	// Out is not embedded: its WriteFrameAsync would write the stream.
	Out          *Output
	Chunks, Sent int64
}

// Format implements the capture's formattedOutput: chunks carry their
// content id.
func (a *AheadOutput) Format() pipeline.Format { return pipeline.Format{ChunkHashes: true} }

// Knows implements the capture's dedup test: a chunk the receiver has
// is neither encoded nor sent again.
func (a *AheadOutput) Knows(id [32]byte) bool { return a.Out.PeerHas(id) }

// WriteFrame implements streamer.Output.
func (a *AheadOutput) WriteFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (streamer.FramePos, error) {
	if fh.Type != manifest.FrameData || codec.ID(fh.Codec) == codec.Zero || len(payload) == 0 {
		return streamer.FramePos{}, nil
	}
	if err := a.Out.SendChunk(ctx, wire.Chunk{Codec: fh.Codec, RawLen: fh.RawLen, CRC: fh.Checksum, ID: fh.Hash, Stored: payload}); err != nil {
		return streamer.FramePos{}, err
	}
	a.Chunks++
	a.Sent += int64(len(payload))
	return streamer.FramePos{}, nil
}

// Commit implements streamer.Output: the chunks are queued; the stream
// that follows them on each connection is what the receiver checks.
func (a *AheadOutput) Commit(context.Context, *manifest.Manifest) error { return a.Out.Err() }

// Abort implements streamer.Output; the caller cancels the transfer.
func (a *AheadOutput) Abort(context.Context) error { return nil }
