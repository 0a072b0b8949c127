package manifest

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/gpucr/gpucr-stream/errdefs"
)

// KeyIDSize is the length of a key id: a public name of the master key
// (package crypt derives it), never the key.
const KeyIDSize = 8

// KeyID names the master key of an encrypted checkpoint; hex in JSON.
type KeyID [KeyIDSize]byte

func (k KeyID) String() string { return hex.EncodeToString(k[:]) }

// MarshalText implements encoding.TextMarshaler.
func (k KeyID) MarshalText() ([]byte, error) { return []byte(k.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (k *KeyID) UnmarshalText(b []byte) error {
	if hex.DecodedLen(len(b)) != len(k) {
		return fmt.Errorf("key id: want %d hex digits, got %d", 2*len(k), len(b))
	}
	_, err := hex.Decode(k[:], b)
	return err
}

// Encryption are the public parameters of an encrypted checkpoint, the
// same in its manifest and in the KEY frame of every stream, shard and
// segment: which cipher, which key (by id), the checkpoint's salt, and its
// stream id (bound into every chunk).
type Encryption struct {
	Cipher   uint8  `json:"cipher"`
	KeyID    KeyID  `json:"key_id"`
	Salt     Hash   `json:"salt"`
	StreamID uint64 `json:"stream_id"`
}

// keyFrame is the KEY frame that carries e.
func (e *Encryption) keyFrame() (FrameHeader, []byte) {
	return FrameHeader{Type: FrameKey, Codec: e.Cipher, Offset: e.StreamID, Hash: e.Salt}, e.KeyID[:]
}

func encryptionFromFrame(f Frame) *Encryption {
	e := &Encryption{Cipher: f.Codec, Salt: f.Hash, StreamID: f.Offset}
	copy(e.KeyID[:], f.Payload)
	return e
}

// macKey comes right before checksumKey: the MAC covers the whole document
// with its own value zeroed and the checksum's empty; the checksum then
// covers the MAC.
const macKey = `"mac": "`

// macLen is the MAC's length in hex digits (HMAC-SHA256).
const macLen = 64

// ErrNoMAC means an encrypted manifest carries no usable MAC.
var ErrNoMAC = fmt.Errorf("manifest: encrypted but without a MAC: %w", errdefs.ErrCorrupt)

// macInput returns what the MAC of doc covers: doc with the MAC's digits
// zeroed and the checksum's value removed. It fails on documents without
// the two fields where the writer puts them.
func macInput(doc []byte) ([]byte, error) {
	ck := bytes.LastIndex(doc, []byte(checksumKey))
	mk := bytes.LastIndex(doc, []byte(macKey))
	// The MAC's digits must lie wholly before the checksum's key.
	if ck < 0 || mk < 0 || mk+len(macKey)+macLen > ck {
		return nil, ErrNoMAC
	}
	ci := ck + len(checksumKey)
	mi := mk + len(macKey)
	end := bytes.IndexByte(doc[ci:], '"')
	if end < 0 {
		return nil, ErrNoMAC
	}
	out := make([]byte, 0, len(doc))
	out = append(out, doc[:mi]...)
	out = append(out, bytes.Repeat([]byte{'0'}, macLen)...)
	out = append(out, doc[mi+macLen:ci]...)
	return append(out, doc[ci+end:]...), nil
}

// CheckMAC authenticates an encrypted manifest document (the bytes Parse
// was given): check(input, tag) must compare tag with the MAC of input.
func CheckMAC(doc []byte, check func(input, tag []byte) bool) error {
	in, err := macInput(doc)
	if err != nil {
		return err
	}
	mi := bytes.LastIndex(doc, []byte(macKey)) + len(macKey) // in range: macInput checked
	tag, err := hex.DecodeString(string(doc[mi : mi+macLen]))
	if err != nil || !check(in, tag) {
		return errors.New("manifest: MAC does not match: the manifest was changed or belongs to another key")
	}
	return nil
}
