// Package codec holds the chunk codecs of the archive format: the codec ids
// written into every frame, the encoders that pick one of them per chunk, the
// decoders, and the checksums that travel with each chunk.
//
// Everything here is a pure function of its arguments (apart from shared,
// lazily built zstd coders and buffer pools), safe for concurrent use, and
// knows nothing of the rest of gpucr-stream. Parallelism belongs to the
// caller: one chunk is encoded or decoded on one goroutine, so many chunks
// can be in flight at once without relying on a library's own concurrency.
//
// Decoders treat their input as untrusted: a malformed chunk yields an error,
// never a panic, and no decoder produces or allocates more than MaxChunk
// bytes.
package codec

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"strconv"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/pierrec/lz4/v4"
)

// ID identifies a chunk encoding in the archive format. IDs are permanent:
// never renumber or reuse.
type ID uint8

// Codec ids. New codecs get new numbers; a reader refuses ids it does not
// know.
const (
	None         ID = 0 // stored raw
	Zero         ID = 1 // all-zero chunk, empty payload
	LZ4          ID = 2 // one LZ4 block, no frame (written by lz4block.go, read by pierrec/lz4/v4)
	Zstd         ID = 3 // one zstd frame: klauspost EncodeAll, or literal-only (litframe.go)
	Shuffle2Zstd ID = 4 // byte-plane shuffle with 2-byte elements (bf16/fp16), then zstd
	Shuffle4Zstd ID = 5 // byte-plane shuffle with 4-byte elements (fp32), then zstd
)

// MaxChunk is the largest raw chunk any decoder will produce; a larger rawLen
// is an error, never an allocation.
const MaxChunk = 64 << 20

// String returns the codec's name as used in manifests and statistics.
func (id ID) String() string {
	switch id {
	case None:
		return "none"
	case Zero:
		return "zero"
	case LZ4:
		return "lz4"
	case Zstd:
		return "zstd"
	case Shuffle2Zstd:
		return "shuffle2+zstd"
	case Shuffle4Zstd:
		return "shuffle4+zstd"
	}
	return "codec(" + strconv.Itoa(int(id)) + ")"
}

// Errors returned (wrapped) by Decode; test with errors.Is.
var (
	// ErrUnknownCodec: the id is not one this version knows (a newer writer).
	ErrUnknownCodec = errors.New("codec: unknown codec id")
	// ErrTooLarge: rawLen exceeds MaxChunk.
	ErrTooLarge = fmt.Errorf("codec: chunk larger than MaxChunk: %w", errdefs.ErrCorrupt)
	// ErrChecksum: the decoded bytes do not match the stored checksum.
	ErrChecksum = fmt.Errorf("codec: checksum mismatch: %w", errdefs.ErrCorrupt)
)

// Decode decodes src (encoded with id) into dst, which must have
// len(dst) == rawLen (caller allocates). It returns an error (never panics)
// when src is malformed, the id is unknown, or the output length differs from
// rawLen. dst and src must not overlap, except for None where any overlap is
// fine. Decode does not verify the checksum: the caller compares Checksum(dst)
// with the one stored in the frame.
func Decode(id ID, dst, src []byte) error {
	if len(dst) > MaxChunk {
		return fmt.Errorf("%w: raw length %d > %d", ErrTooLarge, len(dst), MaxChunk)
	}
	switch id {
	case None:
		if len(src) != len(dst) {
			return fmt.Errorf("%w: stored chunk has %d bytes, want %d", errdefs.ErrCorrupt, len(src), len(dst))
		}
		// Decoded in place, it is left as it is: src may be memory that
		// others read at the same time and nobody may write.
		if len(dst) > 0 && &dst[0] != &src[0] {
			copy(dst, src)
		}
		return nil
	case Zero:
		if len(src) != 0 {
			return fmt.Errorf("%w: zero chunk carries %d payload bytes", errdefs.ErrCorrupt, len(src))
		}
		clear(dst)
		return nil
	case LZ4:
		n, err := lz4.UncompressBlock(src, dst)
		if err != nil {
			return fmt.Errorf("%w: lz4 decode: %w", errdefs.ErrCorrupt, err)
		}
		if n != len(dst) {
			return fmt.Errorf("%w: lz4 decode: got %d bytes, want %d", errdefs.ErrCorrupt, n, len(dst))
		}
		return nil
	case Zstd:
		return zstdDecode(dst, src)
	case Shuffle2Zstd, Shuffle4Zstd:
		k := elemSize(id)
		buf := getBuf(len(dst))
		defer putBuf(buf)
		if err := zstdDecode(*buf, src); err != nil {
			return fmt.Errorf("%v: %w", id, err)
		}
		unshuffle(dst, *buf, k)
		return nil
	}
	return fmt.Errorf("%w: %v", ErrUnknownCodec, id)
}

// DecodeChecked is Decode followed by the check that Checksum(dst) equals
// sum, the CRC-32C stored with the chunk. Some corruptions still decode to
// the right length; only the checksum catches those.
func DecodeChecked(id ID, dst, src []byte, sum uint32) error {
	if err := Decode(id, dst, src); err != nil {
		return err
	}
	if got := Checksum(dst); got != sum {
		return fmt.Errorf("%w: %v chunk of %d bytes has CRC-32C %08x, want %08x", ErrChecksum, id, len(dst), got, sum)
	}
	return nil
}

// elemSize is the shuffle element size of a shuffle codec.
func elemSize(id ID) int {
	if id == Shuffle4Zstd {
		return 4
	}
	return 2
}

// MaxEncodedLen bounds the stored size of a rawLen-byte chunk encoded with
// id, including the scratch room the compressor needs before it knows the
// result; Encode appends into dst without reallocating when cap(dst) is at
// least this. For an unknown id it returns the bound of the worst codec.
func MaxEncodedLen(id ID, rawLen int) int {
	switch id {
	case None:
		return rawLen
	case Zero:
		return 0
	case LZ4:
		return lz4.CompressBlockBound(rawLen)
	case Zstd, Shuffle2Zstd, Shuffle4Zstd:
		return zstdBound(rawLen)
	}
	return max(lz4.CompressBlockBound(rawLen), zstdBound(rawLen))
}

// zstdBound is an upper bound of klauspost's EncodeAll output: frame header
// (at most 18 bytes) plus 3 bytes per block (blocks are >= 64 KiB) plus the
// input itself, stored raw in the worst case. n>>8 covers the block headers
// with a wide margin.
func zstdBound(n int) int { return n + n>>8 + 32 }

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Checksum is the CRC-32C (Castagnoli) of raw bytes: checked after every
// decode. CRC-32C runs on the CPU's crc32 instruction (many GB/s), so it costs
// little next to any codec.
func Checksum(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// UpdateChecksum continues a CRC-32C: UpdateChecksum(Checksum(a), b) is
// Checksum of a followed by b.
func UpdateChecksum(crc uint32, b []byte) uint32 { return crc32.Update(crc, castagnoli, b) }

// ContentHash is the BLAKE3-256 of raw bytes (lukechampine.com/blake3's
// kernels, AVX-512 where present, on the calling goroutine: blake3.go): the
// chunk identity for future delta checkpoints. It hashes raw bytes, never
// stored ones, so that identity does not depend on the codec chosen.
func ContentHash(b []byte) [32]byte { return contentHash(b) }

// zeroBlock is compared against with bytes.Equal, which runs the runtime's
// vectorised memequal; it lives in BSS and stays on the shared zero page.
var zeroBlock [16 << 10]byte

// IsZero reports whether every byte of b is zero.
func IsZero(b []byte) bool {
	// Most non-zero chunks differ in their first word: answer those at once.
	if len(b) >= 8 && binary.LittleEndian.Uint64(b) != 0 {
		return false
	}
	for len(b) >= len(zeroBlock) {
		if !bytes.Equal(b[:len(zeroBlock)], zeroBlock[:]) {
			return false
		}
		b = b[len(zeroBlock):]
	}
	return bytes.Equal(b, zeroBlock[:len(b)])
}
