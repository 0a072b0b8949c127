package streamer

// The capture's half of encryption at rest (the conventions both sides
// share: package pipeline, seal.go).

import (
	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
)

// sealChunk is the capture stage after encoding: it hides the codec's
// output and the raw CRC-32C under the checkpoint's key, in place where
// the buffer has room, and keeps only the buffer the sealed bytes are in.
func (c *Capture) sealChunk(it *item) error {
	var id codec.ID
	var stored []byte
	// The zero test and CRC-32C are the producer's (chunkSums).
	if it.sums.zero {
		// Zero chunks are sealed too (an empty payload and the CRC): an
		// unsealed zero chunk would let anyone turn data into zeros.
		id, stored = codec.Zero, make([]byte, 0, crypt.Overhead)
		it.crc, it.hash = c.sums.Zero(len(it.raw))
	} else {
		it.crc, it.hash = it.sums.crc, c.sums.Content(it.raw)
		if c.shared {
			return c.sealShared(it)
		}
		var err error
		if id, stored, err = c.encodeRaw(it); err != nil {
			return err
		}
	}
	ch := crypt.Chunk{FileID: it.fileID, Name: it.name, Offset: uint64(it.off), RawLen: uint32(it.rawLen), Codec: uint8(id)}
	sealed := c.seal.Seal(stored[:0], stored, it.crc, ch)
	// The raw CRC-32C travels inside the sealed payload; the frame and the
	// manifest carry 0.
	it.codec, it.stored, it.crc = id, sealed, 0
	if &sealed[0] == &it.raw[:1][0] {
		c.bufs.Put(it.encBuf) // sealed in place over the raw chunk
		it.encBuf = nil
		return nil
	}
	c.dropRaw(it)
	if it.encBuf != nil && &sealed[0] != &it.encBuf[:1][0] {
		c.bufs.Put(it.encBuf)
		it.encBuf = nil
	}
	return nil
}

// sealShared seals a chunk for a chunk store (format 4): bound to its keyed
// id, not to this checkpoint, since every checkpoint of the key that holds
// the same chunk references it. A chunk the store holds is not encoded.
func (c *Capture) sealShared(it *item) error {
	if c.knows != nil && c.knows(it.hash) {
		it.codec, it.stored, it.crc = codec.None, nil, 0
		c.dropRaw(it)
		return nil
	}
	id, stored, err := c.encodeRaw(it)
	if err != nil {
		return err
	}
	// The salt goes first, so the sealed bytes go to a buffer of their
	// own; raw and encoded are free after.
	buf := c.bufs.Get()
	sealed := c.seal.SealShared(buf[:0], stored, it.crc, it.hash, uint32(it.rawLen), uint8(id))
	c.dropRaw(it)
	c.bufs.Put(it.encBuf)
	it.encBuf = buf
	it.codec, it.stored, it.crc = id, sealed, 0
	return nil
}
