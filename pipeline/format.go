package pipeline

import (
	"encoding/binary"
	"sync"
	"sync/atomic"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
)

// Format is what an output writes: whether its chunks are sealed, and
// whether they carry a BLAKE3 hash beside their CRC-32C. Restore checks
// the CRC-32C alone; the hash costs about a fifth of a plain capture's CPU
// (docs/bench-log/2026-11.md) and buys verify a second, stronger check, so it is
// asked for, not the default. An encrypted checkpoint always has them,
// keyed (docs/ENCRYPTION.md).
type Format struct {
	// Seal encrypts every chunk under this session (format 2); nil writes
	// a plain checkpoint.
	Seal *crypt.Session
	// ChunkHashes hashes every chunk of a plain checkpoint with BLAKE3
	// (format 1); without, it is written as format 3.
	ChunkHashes bool
	// Shared: the chunks go to a chunk store shared by checkpoints
	// (format 4); sealed ones are bound to their keyed id, not to this
	// checkpoint (crypt.Session.SealShared).
	Shared bool
	// LateData: DATA frames may follow their file's FILE-END (format 5),
	// as a capture sending CRIU's page images last writes them.
	LateData bool
}

// NewFormat is the format of one new output written with o: sealed under
// a new session when o has a key, with chunk hashes when o asks for them.
func (o Options) NewFormat() (Format, error) {
	f := Format{ChunkHashes: o.ChunkHashes, LateData: o.LateData}
	if o.Key == nil {
		return f, nil
	}
	var err error
	f.Seal, err = crypt.NewSession(o.Key)
	return f, err
}

// NoChunkHashes says the chunks carry only their CRC-32C.
func (f Format) NoChunkHashes() bool { return f.Seal == nil && !f.ChunkHashes }

// Digester computes content hashes and file digests: plain BLAKE3, keyed
// when the checkpoint is encrypted (a plain hash of a small chunk would
// give its content away), or none at all when its chunks carry only their
// CRC-32C, whose file digests then cover the CRCs and lengths. Writers
// and readers of one checkpoint must use the same.
type Digester struct {
	Seal          *crypt.Session
	NoChunkHashes bool
}

// Digester is the digester of a checkpoint written in f.
func (f Format) Digester() Digester { return Digester{f.Seal, f.NoChunkHashes()} }

// Content is a chunk's content hash.
func (h Digester) Content(raw []byte) [32]byte {
	switch {
	case h.Seal != nil:
		return h.Seal.Hash(raw)
	case h.NoChunkHashes:
		return [32]byte{}
	}
	return codec.ContentHash(raw)
}

// Zero returns the CRC-32C and hash of n zero bytes.
func (h Digester) Zero(n int) (uint32, [32]byte) {
	crc, hash := zeroSums(n)
	switch {
	case h.Seal != nil:
		hash = h.Seal.ZeroHash(n)
	case h.NoChunkHashes:
		hash = [32]byte{}
	}
	return crc, hash
}

// Chunk appends what a file's digest covers of one chunk: its hash, or,
// without chunk hashes, AppendDigestCRC's.
func (h Digester) Chunk(dst []byte, crc, rawLen uint32, hash [32]byte) []byte {
	if h.NoChunkHashes {
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

// Digest is a file's digest from what Chunk appended for each of its
// chunks, in order.
func (h Digester) Digest(chunks []byte, size int64) [32]byte {
	if h.Seal != nil {
		return h.Seal.Digest(chunks, size)
	}
	return FileDigest(chunks, size)
}

// FileDigest identifies a whole file from what Digester.Chunk took of
// each of its chunks (their hashes, or their CRC-32C and lengths), so that
// it can be computed in parallel and checked without rehashing the data.
func FileDigest(chunks []byte, size int64) [32]byte {
	b := make([]byte, len(chunks)+8)
	copy(b, chunks)
	binary.LittleEndian.PutUint64(b[len(chunks):], uint64(size))
	return codec.ContentHash(b)
}

// zeroSumCache holds the sums of the zero-chunk lengths seen, at most
// maxZeroSums of them: an honest image has a few (the chunk size and the
// tails of files), and a hostile stream that declares a new length in
// every frame must not grow it without bound.
var (
	zeroSumCache sync.Map // int -> sums
	zeroSumCount atomic.Int32
)

const maxZeroSums = 64

type sums struct {
	crc  uint32
	hash [32]byte
}

// zeroSums returns the checksum and hash of n zero bytes; zero chunks are
// common (touched but unused memory) and all have the same few lengths.
// Lengths over MaxChunk (refused by every reader) get zero sums.
func zeroSums(n int) (uint32, [32]byte) {
	if v, ok := zeroSumCache.Load(n); ok {
		s := v.(sums)
		return s.crc, s.hash
	}
	if n < 0 || n > codec.MaxChunk {
		return 0, [32]byte{}
	}
	s := sums{codec.ZeroChecksum(int64(n)), codec.ZeroHash(n)}
	if zeroSumCount.Add(1) <= maxZeroSums {
		zeroSumCache.Store(n, s)
	}
	return s.crc, s.hash
}
