package streamer

// Encryption at rest, as one stage on each side of the pipeline: a capture
// worker seals a chunk right after encoding it (compression first: sealed
// bytes do not compress), a reader opens it right before decoding. Outputs
// and sources only carry the session; no store or transport sees a key.
// Design and guarantees: docs/ENCRYPTION.md; nonces and keys: package crypt.

import (
	"fmt"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/manifest"
)

// encryptionOf converts a session's parameters to their manifest form.
func encryptionOf(s *crypt.Session) *manifest.Encryption {
	if s == nil {
		return nil
	}
	p := s.Params()
	return &manifest.Encryption{Cipher: p.Cipher, KeyID: manifest.KeyID(p.KeyID), Salt: p.Salt, StreamID: p.StreamID}
}

// openSession returns the session for a checkpoint with encryption e (nil
// when not encrypted), read with key (nil when none was given). A key given
// for an unencrypted checkpoint is refused: such a checkpoint is not
// authenticated, and accepting it would let anyone who can write the
// store replace an encrypted checkpoint with a plain one of their making.
func openSession(key *crypt.Key, e *manifest.Encryption) (*crypt.Session, error) {
	if e == nil {
		if key != nil {
			return nil, fmt.Errorf("%w, but key %s was given: refusing an unauthenticated checkpoint", crypt.ErrNotEncrypted, key.ID())
		}
		return nil, nil
	}
	return crypt.Open(key, crypt.Params{Cipher: e.Cipher, KeyID: crypt.KeyID(e.KeyID), Salt: e.Salt, StreamID: e.StreamID})
}

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
		it.crc, it.hash = c.sums.zero(len(it.raw))
	} else {
		it.crc, it.hash = it.sums.crc, c.sums.content(it.raw)
		var dst []byte
		if c.encDst {
			it.encBuf = c.bufs.Get()
			dst = it.encBuf[:0]
		}
		var err error
		if id, stored, err = c.enc.Encode(dst, it.raw); err != nil {
			return fmt.Errorf("encode chunk at offset %d: %w", it.off, err)
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

// openChunk is the reader stage before decoding: it authenticates and
// decrypts a sealed DATA payload in place and returns the encoded chunk and
// the raw bytes' CRC-32C. For a zero chunk the encoded chunk must be empty
// and the CRC that of zeros.
func openChunk(s *crypt.Session, payload []byte, ch crypt.Chunk) ([]byte, uint32, error) {
	enc, crc, err := s.OpenChunk(payload, ch)
	if err != nil {
		return nil, 0, fmt.Errorf("%s chunk of %d bytes: %w", codec.ID(ch.Codec), ch.RawLen, err)
	}
	return enc, crc, nil
}

// marshalManifest encodes m, with its MAC when seal is set.
func marshalManifest(m *manifest.Manifest, seal *crypt.Session) ([]byte, error) {
	if seal == nil {
		return m.Marshal()
	}
	return m.MarshalMAC(func(in []byte) []byte {
		tag := seal.MAC("manifest", in)
		return tag[:]
	})
}

// checkManifestMAC authenticates an encrypted manifest document.
func checkManifestMAC(doc []byte, seal *crypt.Session) error {
	err := manifest.CheckMAC(doc, func(in, tag []byte) bool { return seal.CheckMAC("manifest", in, tag) })
	if err != nil {
		return fmt.Errorf("%w: %w", err, crypt.ErrAuth)
	}
	return nil
}

// sealEnd makes an encrypted stream's END frame authenticate all of it
// (manifest.Writer.SetEndTag): no file can be dropped, added or put back in
// an older version without the key.
func sealEnd(w *manifest.Writer, seal *crypt.Session) {
	if seal != nil {
		w.SetEndTag(func(in []byte) [32]byte { return seal.MAC("end", in) })
	}
}

// checkEnd is sealEnd's reader side.
func checkEnd(r *manifest.Reader, seal *crypt.Session) {
	r.SetEndCheck(func(in []byte, tag [32]byte) error {
		if !seal.CheckMAC("end", in, tag[:]) {
			return fmt.Errorf("the stream's frames were changed, dropped, added or reordered: %w", crypt.ErrAuth)
		}
		return nil
	})
}
