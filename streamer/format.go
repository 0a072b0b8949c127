package streamer

import (
	"encoding/binary"
	"errors"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/manifest"
)

// Format is what an output writes: whether its chunks are sealed, and
// whether they carry a BLAKE3 hash beside their CRC-32C. Restore checks
// the CRC-32C alone; the hash costs about a fifth of a plain capture's CPU
// (docs/BENCHMARKS.md) and buys verify a second, stronger check, so it is
// asked for, not the default. An encrypted checkpoint always has them,
// keyed (docs/ENCRYPTION.md).
type Format struct {
	// Seal encrypts every chunk under this session (format 2); nil writes
	// a plain checkpoint.
	Seal *crypt.Session
	// ChunkHashes hashes every chunk of a plain checkpoint with BLAKE3
	// (format 1); without, it is written as format 3.
	ChunkHashes bool
}

// NewFormat is the format of one new output written with o: sealed under
// a new session when o has a key, with chunk hashes when o asks for them.
func (o Options) NewFormat() (Format, error) {
	f := Format{ChunkHashes: o.ChunkHashes}
	if o.Key == nil {
		return f, nil
	}
	var err error
	f.Seal, err = crypt.NewSession(o.Key)
	return f, err
}

// noChunkHashes says the chunks carry only their CRC-32C.
func (f Format) noChunkHashes() bool { return f.Seal == nil && !f.ChunkHashes }

// header is the stream header every shard or segment of f starts with.
func (f Format) header(index, count uint16, id uint64) manifest.Header {
	return manifest.Header{ShardIndex: index, ShardCount: count, StreamID: id,
		Encryption: encryptionOf(f.Seal), NoChunkHashes: f.noChunkHashes()}
}

// formattedOutput is an Output that says what it writes; one that does
// not writes Format{}.
type formattedOutput interface {
	Format() Format
}

// outputFormat is what out writes.
func outputFormat(out Output) Format {
	if f, ok := out.(formattedOutput); ok {
		return f.Format()
	}
	return Format{}
}

// Format implements formattedOutput: both outputs must write the same
// frames, so they must share one format (and session, or both have none).
func (t TeeOutput) Format() Format {
	return outputFormat(t.Primary)
}

// errTeeFormats is returned when a TeeOutput's outputs disagree.
var errTeeFormats = errors.New("capture: the outputs of a tee must share one format and encryption session")

func checkTee(out Output) error {
	if t, ok := out.(TeeOutput); ok && outputFormat(t.Primary) != outputFormat(t.Copy) {
		return errTeeFormats
	}
	return nil
}

// digester computes content hashes and file digests: plain BLAKE3, keyed
// when the checkpoint is encrypted (a plain hash of a small chunk would
// give its content away), or none at all when its chunks carry only their
// CRC-32C, whose file digests then cover the CRCs and lengths.
type digester struct {
	seal          *crypt.Session
	noChunkHashes bool
}

func (f Format) digester() digester { return digester{f.Seal, f.noChunkHashes()} }

func (h digester) content(raw []byte) [32]byte {
	switch {
	case h.seal != nil:
		return h.seal.Hash(raw)
	case h.noChunkHashes:
		return [32]byte{}
	}
	return codec.ContentHash(raw)
}

// zero returns the CRC-32C and hash of n zero bytes.
func (h digester) zero(n int) (uint32, [32]byte) {
	crc, hash := zeroSums(n)
	switch {
	case h.seal != nil:
		hash = h.seal.ZeroHash(n)
	case h.noChunkHashes:
		hash = [32]byte{}
	}
	return crc, hash
}

// chunk appends what a file's digest covers of one chunk: its hash, or,
// without chunk hashes, AppendDigestCRC's.
func (h digester) chunk(dst []byte, crc, rawLen uint32, hash [32]byte) []byte {
	if h.noChunkHashes {
		return AppendDigestCRC(dst, crc, rawLen)
	}
	return append(dst, hash[:]...)
}

// AppendDigestCRC appends what a file's digest (FileDigest) covers of one
// chunk in a checkpoint without chunk hashes: its CRC-32C and raw length,
// u32 LE each.
func AppendDigestCRC(dst []byte, crc, rawLen uint32) []byte {
	dst = binary.LittleEndian.AppendUint32(dst, crc)
	return binary.LittleEndian.AppendUint32(dst, rawLen)
}

// digest is a file's digest from what chunk appended for each of its
// chunks, in order.
func (h digester) digest(chunks []byte, size int64) [32]byte {
	if h.seal != nil {
		return h.seal.Digest(chunks, size)
	}
	return FileDigest(chunks, size)
}
