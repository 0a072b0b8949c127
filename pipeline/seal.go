package pipeline

// Encryption at rest, as one stage on each side of the pipeline: a capture
// worker seals a chunk right after encoding it (compression first: sealed
// bytes do not compress; package streamer), a reader opens it right before
// decoding (package source). Outputs and sources only carry the session; no
// store or transport sees a key. This file holds what the two sides must
// agree on: the session's manifest form, and the MACs over the manifest
// and over a whole stream. Design and guarantees: docs/ENCRYPTION.md;
// nonces and keys: package crypt.

import (
	"fmt"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/manifest"
)

// EncryptionOf converts a session's parameters to their manifest form.
func EncryptionOf(s *crypt.Session) *manifest.Encryption {
	if s == nil {
		return nil
	}
	p := s.Params()
	return &manifest.Encryption{Cipher: p.Cipher, KeyID: manifest.KeyID(p.KeyID), Salt: p.Salt, StreamID: p.StreamID}
}

// OpenSession returns the session for a checkpoint with encryption e (nil
// when not encrypted), read with key (nil when none was given). A key given
// for an unencrypted checkpoint is refused: such a checkpoint is not
// authenticated, and accepting it would let anyone who can write the
// store replace an encrypted checkpoint with a plain one of their making.
func OpenSession(key *crypt.Key, e *manifest.Encryption) (*crypt.Session, error) {
	if e == nil {
		if key != nil {
			return nil, fmt.Errorf("%w, but key %s was given: refusing an unauthenticated checkpoint", crypt.ErrNotEncrypted, key.ID())
		}
		return nil, nil
	}
	return crypt.Open(key, crypt.Params{Cipher: e.Cipher, KeyID: crypt.KeyID(e.KeyID), Salt: e.Salt, StreamID: e.StreamID})
}

// MarshalManifest encodes m, with its MAC when seal is set.
func MarshalManifest(m *manifest.Manifest, seal *crypt.Session) ([]byte, error) {
	if seal == nil {
		return m.Marshal()
	}
	return m.MarshalMAC(func(in []byte) []byte {
		tag := seal.MAC("manifest", in)
		return tag[:]
	})
}

// CheckManifestMAC authenticates an encrypted manifest document.
func CheckManifestMAC(doc []byte, seal *crypt.Session) error {
	err := manifest.CheckMAC(doc, func(in, tag []byte) bool { return seal.CheckMAC("manifest", in, tag) })
	if err != nil {
		return fmt.Errorf("%w: %w", err, crypt.ErrAuth)
	}
	return nil
}

// SealEnd makes an encrypted stream's END frame authenticate all of it
// (manifest.Writer.SetEndTag): no file can be dropped, added or put back in
// an older version without the key.
func SealEnd(w *manifest.Writer, seal *crypt.Session) {
	if seal != nil {
		w.SetEndTag(func(in []byte) [32]byte { return seal.MAC("end", in) })
	}
}

// CheckEnd is SealEnd's reader side.
func CheckEnd(r *manifest.Reader, seal *crypt.Session) {
	r.SetEndCheck(func(in []byte, tag [32]byte) error {
		if !seal.CheckMAC("end", in, tag[:]) {
			return fmt.Errorf("the stream's frames were changed, dropped, added or reordered: %w", crypt.ErrAuth)
		}
		return nil
	})
}
