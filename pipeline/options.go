package pipeline

import (
	"runtime"
	"sync/atomic"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
)

// Options tune the pipeline. Zero values pick the defaults.
type Options struct {
	// ChunkSize is the largest raw chunk; files smaller than it stay whole.
	ChunkSize int
	// Workers is the number of encoder (or decoder) goroutines.
	Workers int
	// MemoryLimit bounds the chunk buffers in flight (raw and encoded).
	MemoryLimit int64
	// Codec chooses the chunk encoding.
	Codec codec.Spec
	// VerifyHashes makes readers also check every chunk's BLAKE3 content
	// hash (verify does; restore relies on the CRC-32C alone for speed).
	VerifyHashes bool
	// Fetchers is the number of chunk reads an archive source keeps in
	// flight per file (default: Workers). Object stores want more than
	// there are cores, since each read mostly waits on the network.
	Fetchers int
	// Key opens encrypted checkpoints; readers given one refuse
	// unencrypted input. Writers encrypt when their Output has a session.
	Key *crypt.Key
	// ChunkHashes makes the outputs opened with these options (package
	// location, migrate) hash every chunk with BLAKE3 (Format); a Capture
	// writes what its Output's format says.
	ChunkHashes bool
	// Dedup makes the archive outputs opened with these options (package
	// location) deduplicated checkpoints (format 4): their chunks go to
	// the chunk store of the location that holds them, once for every
	// checkpoint there.
	Dedup bool
	// LateData (--pages-last) makes a Capture hold the non-zero chunks of
	// CRIU's page images back (in memory, beyond half of it in $TMPDIR)
	// and write them late, after every other frame, so that a restore
	// from the stream can start before they arrive (streamer/late.go maps
	// the names). Streams of format 5 only (Format.LateData).
	LateData bool
}

const (
	DefaultChunkSize   = 4 << 20
	DefaultMemoryLimit = 256 << 20
)

// WithDefaults returns o with every zero value replaced by its default.
func (o Options) WithDefaults() Options {
	if o.ChunkSize <= 0 {
		o.ChunkSize = DefaultChunkSize
	}
	if o.ChunkSize > codec.MaxChunk {
		o.ChunkSize = codec.MaxChunk
	}
	if o.Workers <= 0 {
		o.Workers = runtime.GOMAXPROCS(0)
	}
	if o.MemoryLimit <= 0 {
		o.MemoryLimit = DefaultMemoryLimit
	}
	return o
}

// Counters are live totals, readable while the pipeline runs.
type Counters struct {
	Files       atomic.Int64
	RawBytes    atomic.Int64
	StoredBytes atomic.Int64
	// StoredRaw is the raw size of the chunks counted in StoredBytes: the
	// ratio of the two holds while RawBytes runs ahead of what is stored.
	StoredRaw atomic.Int64
}
