package codec

import (
	"fmt"
	"sync"

	"github.com/klauspost/compress/zstd"
)

// Encoder encodes chunks according to a Spec. It is safe for concurrent use
// by many goroutines: zstd goes through one shared klauspost encoder per
// level (EncodeAll), lz4 through pooled compressors (each holds a 128 KiB
// hash table, too big to build per chunk). At most GOMAXPROCS EncodeAll
// calls per level run at once; more callers wait their turn, which is what a
// CPU-bound pool wants anyway.
type Encoder struct {
	spec Spec
	zenc *zstd.Encoder // nil for "none" and "lz4"
}

// NewEncoder returns an Encoder for s.
func NewEncoder(s Spec) (*Encoder, error) {
	e := &Encoder{spec: s}
	switch s.kind {
	case specNone, specLZ4:
	case specAuto, specZstd, specShuffle:
		z, err := zstdEncoder(s.encoderLevel())
		if err != nil {
			return nil, err
		}
		e.zenc = z
	default:
		return nil, fmt.Errorf("codec: invalid spec %v", s)
	}
	return e, nil
}

// Spec returns the spec the Encoder was made with.
func (e *Encoder) Spec() Spec { return e.spec }

// MaxEncodedLen is the largest MaxEncodedLen(id, rawLen) over the ids this
// Encoder may produce: with cap(dst) at least this, Encode does not allocate
// its output.
func (e *Encoder) MaxEncodedLen(rawLen int) int {
	switch e.spec.kind {
	case specNone:
		return 0 // Encode never writes into dst
	case specLZ4:
		return MaxEncodedLen(LZ4, rawLen)
	case specZstd, specShuffle:
		return MaxEncodedLen(Zstd, rawLen)
	}
	return MaxEncodedLen(ID(255), rawLen)
}

// Encode encodes raw, appending the stored bytes to dst[:0] when it
// compresses. Rules: an all-zero chunk gives (Zero, empty); if the encoded
// form is not smaller than raw, it gives (None, raw), returning raw itself,
// no copy; otherwise (id, encoded). dst must not overlap raw. The only error
// is a chunk larger than MaxChunk, which no decoder would accept.
func (e *Encoder) Encode(dst, raw []byte) (id ID, stored []byte, err error) {
	if len(raw) > MaxChunk {
		return None, nil, fmt.Errorf("%w: chunk of %d bytes > %d", ErrTooLarge, len(raw), MaxChunk)
	}
	if IsZero(raw) {
		return Zero, dst[:0], nil
	}
	var p plan
	switch e.spec.kind {
	case specNone:
		p = plan{id: None}
	case specLZ4:
		p = plan{id: LZ4}
		// LZ4 only finds repeats; where a few samples show none (noise,
		// float weights) the whole chunk would be compressed for nothing.
		if len(raw) >= 4*lz4SkipMin && lz4SampleRatio(raw) < lz4SkipRatio {
			p = plan{id: None}
		}
	case specZstd:
		p = plan{id: Zstd}
	case specShuffle:
		p = planShuffle(raw)
	default:
		p = planAuto(raw)
	}
	id, stored = e.encodeAs(p, dst, raw)
	return id, stored, nil
}

const (
	// lz4SkipMin: below 4 samples of this, sampling costs as much as trying.
	lz4SkipMin = 64 << 10
	// lz4SkipRatio: samples that shrink by less than this are stored raw.
	lz4SkipRatio = 1.03
)

// plan is how to encode one chunk: the codec, and for the zstd-based ones
// whether to write a literal-only frame (litFrame) instead of running
// klauspost's full encoder.
type plan struct {
	id  ID
	lit bool
}

// encodeAs encodes raw (not all-zero) as p says, falling back to (None, raw)
// when that is not smaller.
func (e *Encoder) encodeAs(p plan, dst, raw []byte) (ID, []byte) {
	var out []byte
	switch p.id {
	case None:
		return None, raw
	case LZ4:
		out = lz4Encode(dst, raw)
	case Zstd:
		if p.lit {
			out = litFrame(dst[:0], raw)
		} else {
			out = e.zenc.EncodeAll(raw, dst[:0])
		}
	case Shuffle2Zstd, Shuffle4Zstd:
		buf := getBuf(len(raw))
		shuffle(*buf, raw, elemSize(p.id))
		if p.lit {
			out = litFrame(dst[:0], *buf)
		} else {
			out = e.zenc.EncodeAll(*buf, dst[:0])
		}
		putBuf(buf)
	}
	if out == nil || len(out) >= len(raw) {
		return None, raw
	}
	return p.id, out
}

// lz4Tables are reused because a table is 256 KiB.
var lz4Tables = sync.Pool{New: func() any { return new(lz4Table) }}

// lz4Encode compresses raw into dst's storage, or returns nil when the result
// would not be smaller than raw.
func lz4Encode(dst, raw []byte) []byte {
	if len(raw) == 0 {
		return nil
	}
	out := dst[:cap(dst)]
	if len(out) < len(raw) {
		// Room for any result smaller than raw: a larger one is useless.
		out = make([]byte, len(raw))
	}
	t := lz4Tables.Get().(*lz4Table)
	n := t.compress(raw, out[:len(raw)-1])
	lz4Tables.Put(t)
	if n == 0 {
		return nil
	}
	return out[:n]
}
