// Package manifest defines every byte gpucr-stream puts on disk and on the
// wire: the stream header, self-describing frames, the trailer, and the
// manifest document that commits an archive. docs/FORMAT.md describes the same
// layout in prose; the two must change together.
package manifest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"

	"github.com/gpucr/gpucr-stream/errdefs"
)

// Version is the newest format version this code reads. Writers write the
// oldest version that can say what a checkpoint is (VersionOf), so that an
// older reader reads every checkpoint it can read right and refuses the
// others as newer.
const Version = 5

// DocumentVersion is the newest manifest document this code reads: version
// 5 changed streams only.
const DocumentVersion = VersionSharedChunks

const (
	// VersionPlain is the version of an unencrypted stream or manifest
	// whose chunks carry BLAKE3 hashes.
	VersionPlain = 1
	// VersionEncrypted is the version of an encrypted one: a reader of
	// version 1 refuses it as newer instead of misreading ciphertext.
	VersionEncrypted = 2
	// VersionNoChunkHashes is the version of an unencrypted checkpoint
	// whose chunks carry only their CRC-32C: a reader of version 1 or 2
	// refuses it as newer instead of calling every chunk corrupt.
	VersionNoChunkHashes = 3
	// VersionSharedChunks is the version of a checkpoint whose chunks live
	// in its location's shared chunk store (packs and an index, written
	// once for every checkpoint there), and of those packs: a reader of
	// version 3 or older refuses it as newer instead of finding no
	// segments.
	VersionSharedChunks = 4
	// VersionLateData is the version of a stream whose DATA frames may
	// follow their file's FILE-END (HeaderFlagLateData): a reader of
	// version 4 or older refuses it as newer instead of calling those
	// frames corrupt.
	VersionLateData = 5
)

const (
	// HeaderFlagEncrypted (version 2 and later) says a KEY frame follows
	// the header and every DATA payload is sealed.
	HeaderFlagEncrypted = 1
	// HeaderFlagNoChunkHashes (version 3) says DATA frames carry no
	// BLAKE3 hash (the field is zero) and file digests cover the chunks'
	// CRC-32C and lengths instead (docs/FORMAT.md section 8).
	HeaderFlagNoChunkHashes = 2
	// HeaderFlagPack (version 4) says the stream is a pack of a chunk
	// store: DATA frames of file id 0 at offset 0, one per chunk, each
	// carrying its content id in Hash; no FILE or FILE-END frames.
	HeaderFlagPack = 4
	// HeaderFlagLateData (version 5) says DATA frames of a file may come
	// after its FILE-END in the stream: a capture that sends CRIU's page
	// images last (streamer/late.go) announces their end first.
	HeaderFlagLateData = 8
)

// VersionOf is the version a checkpoint is written as: encrypted ones
// always hash their chunks (keyed).
func VersionOf(encrypted, noChunkHashes bool) uint16 {
	switch {
	case encrypted:
		return VersionEncrypted
	case noChunkHashes:
		return VersionNoChunkHashes
	}
	return VersionPlain
}

const (
	// StreamMagic opens every stream, shard and segment.
	StreamMagic = "GPUCRSTM"
	// TailMagic closes a finished stream, after the offset of its END frame.
	TailMagic = "GPUCRIDX"

	HeaderSize = 32
	FrameSize  = 64
	TailSize   = 16

	// MaxNameLen bounds FILE frame payloads; CRIU image names are short.
	MaxNameLen = 4096
	// MaxPayload bounds any payload a reader will allocate for.
	MaxPayload = 64 << 20
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func crc(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// Header opens a stream. Shards of one stream share StreamID.
type Header struct {
	Version    uint16
	Flags      uint32
	ShardIndex uint16
	ShardCount uint16
	StreamID   uint64
	// Encryption, when set, is written as the KEY frame that follows the
	// 32 bytes (Writer) or was read from it (Reader). Not part of Marshal.
	Encryption *Encryption
	// NoChunkHashes: the stream's chunks carry no BLAKE3 hash. Written
	// (Writer) and read (UnmarshalHeader) as HeaderFlagNoChunkHashes.
	NoChunkHashes bool
	// Pack: the stream is a pack of a chunk store (HeaderFlagPack).
	Pack bool
	// LateData: DATA frames may follow their file's FILE-END
	// (HeaderFlagLateData).
	LateData bool
}

// Marshal returns the 32-byte encoding.
func (h Header) Marshal() []byte {
	b := make([]byte, HeaderSize)
	copy(b[0:8], StreamMagic)
	binary.LittleEndian.PutUint16(b[8:], h.Version)
	binary.LittleEndian.PutUint16(b[10:], HeaderSize)
	binary.LittleEndian.PutUint32(b[12:], h.Flags)
	binary.LittleEndian.PutUint16(b[16:], h.ShardIndex)
	binary.LittleEndian.PutUint16(b[18:], h.ShardCount)
	binary.LittleEndian.PutUint64(b[20:], h.StreamID)
	binary.LittleEndian.PutUint32(b[28:], crc(b[:28]))
	return b
}

// ErrNotStream means the bytes do not start with a gpucr-stream header.
var ErrNotStream = errors.New("not a gpucr-stream stream (bad magic)")

// ErrNewerVersion means the stream was written by a newer gpucr-stream.
var ErrNewerVersion = errors.New("format version newer than this gpucr-stream supports")

// UnmarshalHeader checks magic, version and checksum, in that order, so that
// a newer stream is reported as such rather than as corrupt.
func UnmarshalHeader(b []byte) (Header, error) {
	if len(b) < HeaderSize {
		return Header{}, fmt.Errorf("stream header: %d bytes, want %d", len(b), HeaderSize)
	}
	if string(b[0:8]) != StreamMagic {
		return Header{}, fmt.Errorf("%w: got %q", ErrNotStream, printable(b[0:8]))
	}
	h := Header{Version: binary.LittleEndian.Uint16(b[8:])}
	if h.Version == 0 {
		return h, fmt.Errorf("stream header: version 0 does not exist: %w", errdefs.ErrCorrupt)
	}
	if h.Version > Version {
		// A newer version may lay out its header differently, so its
		// checksum can't be checked here; say so rather than guess.
		if crc(b[:28]) != binary.LittleEndian.Uint32(b[28:]) {
			return h, fmt.Errorf("%w: stream says version %d (this build reads up to %d; upgrade gpucr-stream), or its header is damaged: the version 1 header checksum does not match", ErrNewerVersion, h.Version, Version)
		}
		return h, fmt.Errorf("%w: stream is version %d, this build reads up to %d; upgrade gpucr-stream", ErrNewerVersion, h.Version, Version)
	}
	if n := binary.LittleEndian.Uint16(b[10:]); n != HeaderSize {
		return h, fmt.Errorf("stream header: length %d, want %d: %w", n, HeaderSize, errdefs.ErrCorrupt)
	}
	if got, want := crc(b[:28]), binary.LittleEndian.Uint32(b[28:]); got != want {
		return h, fmt.Errorf("stream header: checksum mismatch (stored %08x, computed %08x)", want, got)
	}
	h.Flags = binary.LittleEndian.Uint32(b[12:])
	h.ShardIndex = binary.LittleEndian.Uint16(b[16:])
	h.ShardCount = binary.LittleEndian.Uint16(b[18:])
	h.StreamID = binary.LittleEndian.Uint64(b[20:])
	if h.ShardCount == 0 || h.ShardIndex >= h.ShardCount {
		return h, fmt.Errorf("stream header: shard %d of %d is impossible", h.ShardIndex, h.ShardCount)
	}
	h.NoChunkHashes = h.Version >= VersionNoChunkHashes && h.Flags&HeaderFlagNoChunkHashes != 0
	if h.NoChunkHashes && h.Flags&HeaderFlagEncrypted != 0 {
		return h, fmt.Errorf("stream header: flags %#x: an encrypted stream always hashes its chunks", h.Flags)
	}
	h.Pack = h.Version >= VersionSharedChunks && h.Flags&HeaderFlagPack != 0
	if h.Pack && h.Flags&(HeaderFlagNoChunkHashes|HeaderFlagEncrypted) != 0 {
		return h, fmt.Errorf("stream header: flags %#x: a pack's chunks are plain and named by their hash", h.Flags)
	}
	h.LateData = h.Version >= VersionLateData && h.Flags&HeaderFlagLateData != 0
	if h.LateData && h.Pack {
		return h, fmt.Errorf("stream header: flags %#x: a pack has no files", h.Flags)
	}
	return h, nil
}

// FrameType says what a frame carries.
type FrameType uint8

const (
	// FrameFile opens a file: FileID is bound to the name in the payload. A
	// name opened again replaces the earlier file (CRIU rewrites some images).
	FrameFile FrameType = 1
	// FrameData carries one chunk of a file's bytes.
	FrameData FrameType = 2
	// FrameFileEnd closes a file: Offset is its size, RawLen its chunk count,
	// Hash its digest.
	FrameFileEnd FrameType = 3
	// FrameEnd closes the stream; its payload is the manifest document (JSON)
	// or empty.
	FrameEnd FrameType = 4
	// FrameKey (version 2) follows the header of an encrypted stream: Codec
	// is the cipher, Hash the salt, Offset the stream id, the payload the
	// key id.
	FrameKey FrameType = 5
)

func (t FrameType) String() string {
	switch t {
	case FrameFile:
		return "FILE"
	case FrameData:
		return "DATA"
	case FrameFileEnd:
		return "FILE-END"
	case FrameEnd:
		return "END"
	case FrameKey:
		return "KEY"
	}
	return fmt.Sprintf("frame-type(%d)", uint8(t))
}

// FILE frame flags.
const (
	// FileFlagExternal marks a file that did not come from CRIU
	// (--ext-file-fds, producers, carried files).
	FileFlagExternal = 1
	// FileFlagCarried marks a file the caller put into CRIU's images dir
	// (runc's descriptors.json, --carry): a restore writes it back there
	// before CRIU runs. Set with FileFlagExternal.
	FileFlagCarried = 2
)

// FrameHeader is the fixed 64-byte header in front of every payload.
type FrameHeader struct {
	Type      FrameType
	Codec     uint8
	Flags     uint16
	FileID    uint32
	Offset    uint64
	RawLen    uint32
	StoredLen uint32
	// Checksum is the CRC-32C of the raw (decoded) bytes for DATA frames,
	// and of the payload for the others.
	Checksum uint32
	// Hash is the BLAKE3-256 of the raw bytes for DATA, the file digest for
	// FILE-END, zero otherwise.
	Hash [32]byte
}

// Marshal writes the 64-byte encoding into b.
func (f *FrameHeader) Marshal(b []byte) {
	_ = b[FrameSize-1]
	b[0] = byte(f.Type)
	b[1] = f.Codec
	binary.LittleEndian.PutUint16(b[2:], f.Flags)
	binary.LittleEndian.PutUint32(b[4:], f.FileID)
	binary.LittleEndian.PutUint64(b[8:], f.Offset)
	binary.LittleEndian.PutUint32(b[16:], f.RawLen)
	binary.LittleEndian.PutUint32(b[20:], f.StoredLen)
	binary.LittleEndian.PutUint32(b[24:], f.Checksum)
	copy(b[28:60], f.Hash[:])
	binary.LittleEndian.PutUint32(b[60:], crc(b[:60]))
}

// UnmarshalFrameHeader decodes and checks a frame header; it does not look at
// the payload.
func UnmarshalFrameHeader(b []byte) (FrameHeader, error) {
	var f FrameHeader
	if len(b) < FrameSize {
		return f, fmt.Errorf("frame header: %d bytes, want %d", len(b), FrameSize)
	}
	if got, want := crc(b[:60]), binary.LittleEndian.Uint32(b[60:]); got != want {
		f.FileID = NoFile // nothing in a damaged header can be trusted
		return f, fmt.Errorf("frame header checksum mismatch (stored %08x, computed %08x)", want, got)
	}
	f.Type = FrameType(b[0])
	f.Codec = b[1]
	f.Flags = binary.LittleEndian.Uint16(b[2:])
	f.FileID = binary.LittleEndian.Uint32(b[4:])
	f.Offset = binary.LittleEndian.Uint64(b[8:])
	f.RawLen = binary.LittleEndian.Uint32(b[16:])
	f.StoredLen = binary.LittleEndian.Uint32(b[20:])
	f.Checksum = binary.LittleEndian.Uint32(b[24:])
	copy(f.Hash[:], b[28:60])
	return f, f.validate()
}

func (f *FrameHeader) validate() error {
	if f.StoredLen > MaxPayload {
		return fmt.Errorf("%s frame: payload of %d bytes exceeds the limit of %d", f.Type, f.StoredLen, MaxPayload)
	}
	switch f.Type {
	case FrameFile:
		if f.StoredLen == 0 || f.StoredLen > MaxNameLen {
			return fmt.Errorf("FILE frame: name length %d out of range", f.StoredLen)
		}
	case FrameData:
		if f.RawLen > MaxPayload {
			return fmt.Errorf("DATA frame: raw length %d exceeds the limit of %d", f.RawLen, MaxPayload)
		}
		if f.Offset > 1<<62 {
			return fmt.Errorf("DATA frame: offset %d out of range", f.Offset)
		}
	case FrameFileEnd:
		if f.StoredLen != 0 {
			return fmt.Errorf("FILE-END frame: unexpected payload of %d bytes", f.StoredLen)
		}
	case FrameEnd:
	case FrameKey:
		if f.StoredLen != KeyIDSize {
			return fmt.Errorf("KEY frame: payload of %d bytes, want %d", f.StoredLen, KeyIDSize)
		}
	default:
		return fmt.Errorf("unknown frame type %d", f.Type)
	}
	return nil
}

// PayloadChecksum is what a non-DATA frame stores in Checksum.
func PayloadChecksum(payload []byte) uint32 { return crc(payload) }

// MarshalTail returns the 16 bytes that follow the END frame.
func MarshalTail(endOffset uint64) []byte {
	b := make([]byte, TailSize)
	binary.LittleEndian.PutUint64(b, endOffset)
	copy(b[8:], TailMagic)
	return b
}

// UnmarshalTail returns the END frame's offset from a stream's last 16 bytes.
func UnmarshalTail(b []byte) (uint64, error) {
	if len(b) != TailSize || string(b[8:]) != TailMagic {
		return 0, errors.New("stream tail missing: the stream is truncated or was not finished")
	}
	return binary.LittleEndian.Uint64(b), nil
}

func printable(b []byte) string {
	out := make([]byte, len(b))
	for i, c := range b {
		if c < 0x20 || c > 0x7e {
			c = '.'
		}
		out[i] = c
	}
	return string(out)
}
