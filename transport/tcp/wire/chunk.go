package wire

// Pre-copy (issue 23): while the source process runs, the sender sends the
// chunks of its image as CHUNK records, before the stream's first DATA
// record; the receiver keeps them in a chunk cache, by content id. In the
// stream that follows, a REF record stands for one DATA frame of the
// stream (its 64-byte header and its payload): the receiver puts back the
// header and the cached payload of the chunk the header names by its hash.
// A receiver announces the cache with ReplyChunkCache; a sender sends
// neither record to one that does not.
//
//	CHUNK: u8 version (1), u8 codec, 2 zero bytes, u32 raw length, u32
//	       CRC-32C of the raw chunk, 32-byte content id, stored bytes
//	REF:   u8 version (1), 3 zero bytes, 64-byte frame header

import (
	"encoding/binary"
	"errors"
	"fmt"
)

const (
	// ChunkVersion is the version of the CHUNK and REF payloads.
	ChunkVersion = 1
	// ChunkFixed is a CHUNK payload's size before the stored bytes.
	ChunkFixed = 44
	// MaxChunkStored bounds a CHUNK's stored bytes (the stream's own
	// bound on a payload).
	MaxChunkStored = 64 << 20
	// RefSize is a REF payload's size; RefFrameSize its frame header's.
	RefFrameSize = 64
	RefSize      = 4 + RefFrameSize
	// MaxChunkRaw bounds a chunk's raw length, as the stream does.
	MaxChunkRaw = 64 << 20
)

// Chunk is one chunk sent ahead of the stream.
type Chunk struct {
	Codec  uint8
	RawLen uint32
	CRC    uint32
	ID     [32]byte
	Stored []byte
}

// MarshalChunkHeader encodes c's fixed part (the stored bytes follow it).
func MarshalChunkHeader(c Chunk) []byte {
	b := make([]byte, ChunkFixed)
	b[0], b[1] = ChunkVersion, c.Codec
	binary.LittleEndian.PutUint32(b[4:], c.RawLen)
	binary.LittleEndian.PutUint32(b[8:], c.CRC)
	copy(b[12:44], c.ID[:])
	return b
}

// ParseChunk decodes a CHUNK payload; Stored aliases b.
func ParseChunk(b []byte) (Chunk, error) {
	var c Chunk
	if len(b) < ChunkFixed {
		return c, fmt.Errorf("CHUNK record of %d bytes (at least %d)", len(b), ChunkFixed)
	}
	if b[0] != ChunkVersion {
		return c, fmt.Errorf("CHUNK record version %d; this receiver reads %d (use the same gpucr-stream version on both sides)", b[0], ChunkVersion)
	}
	if b[2]|b[3] != 0 {
		return c, errors.New("CHUNK record with non-zero reserved bytes")
	}
	c.Codec = b[1]
	c.RawLen = binary.LittleEndian.Uint32(b[4:])
	c.CRC = binary.LittleEndian.Uint32(b[8:])
	copy(c.ID[:], b[12:44])
	c.Stored = b[ChunkFixed:]
	switch {
	case c.RawLen == 0 || c.RawLen > MaxChunkRaw:
		return c, fmt.Errorf("CHUNK %x of %d raw bytes (want 1..%d)", c.ID[:8], c.RawLen, MaxChunkRaw)
	case len(c.Stored) == 0 || len(c.Stored) > MaxChunkStored:
		return c, fmt.Errorf("CHUNK %x with %d stored bytes (want 1..%d)", c.ID[:8], len(c.Stored), MaxChunkStored)
	}
	return c, nil
}

// MarshalRef encodes a REF payload for the frame header hdr.
func MarshalRef(hdr []byte) []byte {
	b := make([]byte, RefSize)
	b[0] = ChunkVersion
	copy(b[4:], hdr)
	return b
}

// ParseRef decodes a REF payload into the frame header it carries (which
// the caller checks).
func ParseRef(b []byte) ([]byte, error) {
	if len(b) != RefSize {
		return nil, fmt.Errorf("REF record of %d bytes, want %d", len(b), RefSize)
	}
	if b[0] != ChunkVersion {
		return nil, fmt.Errorf("REF record version %d; this receiver reads %d (use the same gpucr-stream version on both sides)", b[0], ChunkVersion)
	}
	if b[1]|b[2]|b[3] != 0 {
		return nil, errors.New("REF record with non-zero reserved bytes")
	}
	return b[4:], nil
}
