package codec

import (
	"fmt"
	"runtime"
	"sync"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/klauspost/compress/zstd"
)

// One klauspost encoder per EncoderLevel, shared by every Encoder through
// EncodeAll (which is safe for concurrent use and keeps a pool of
// GOMAXPROCS block encoders). Built on first use: each holds MBs of tables.
var zstdEncoders [4]struct {
	once sync.Once
	enc  *zstd.Encoder
	err  error
}

// zstdEncoder returns the shared encoder for level l.
func zstdEncoder(l zstd.EncoderLevel) (*zstd.Encoder, error) {
	i := int(l) - int(zstd.SpeedFastest)
	if i < 0 || i >= len(zstdEncoders) {
		return nil, fmt.Errorf("codec: zstd encoder level %v out of range", l)
	}
	e := &zstdEncoders[i]
	e.once.Do(func() {
		e.enc, e.err = zstd.NewWriter(nil,
			zstd.WithEncoderLevel(l),
			zstd.WithEncoderConcurrency(runtime.GOMAXPROCS(0)),
			// Every frame carries our own CRC-32C of the raw bytes, so
			// zstd's xxhash would be checked twice for nothing.
			zstd.WithEncoderCRC(false),
			// Shuffled float planes have few LZ matches but a skewed byte
			// distribution: without this the fastest levels store such
			// blocks raw and the shuffle gains nothing.
			zstd.WithAllLitEntropyCompression(true),
		)
		if e.err != nil {
			e.err = fmt.Errorf("codec: zstd encoder (%v): %w", l, e.err)
		}
	})
	return e.enc, e.err
}

// zstdDecoder is the one shared decoder, used only through DecodeAll. Its
// memory is bounded for untrusted input: no frame may declare or produce more
// than MaxChunk bytes, and DecodeAll never writes beyond cap(dst), which
// zstdDecode sets to rawLen.
var zstdDecoder = sync.OnceValues(func() (*zstd.Decoder, error) {
	d, err := zstd.NewReader(nil,
		zstd.WithDecoderConcurrency(0), // GOMAXPROCS concurrent DecodeAll calls
		zstd.WithDecoderMaxMemory(MaxChunk),
		zstd.WithDecodeAllCapLimit(true),
	)
	if err != nil {
		return nil, fmt.Errorf("codec: zstd decoder: %w", err)
	}
	return d, nil
})

// zstdDecode decodes the zstd frame(s) in src into dst, which must come out
// exactly full.
func zstdDecode(dst, src []byte) error {
	d, err := zstdDecoder()
	if err != nil {
		return err
	}
	// Reject a frame that declares the wrong size before decoding anything.
	// (Frames under 256 bytes may omit the size; DecodeAll checks those.)
	var h zstd.Header
	if h.Decode(src) == nil && h.HasFCS && h.FrameContentSize != uint64(len(dst)) {
		return fmt.Errorf("%w: zstd decode: frame declares %d bytes, want %d", errdefs.ErrCorrupt, h.FrameContentSize, len(dst))
	}
	out, err := d.DecodeAll(src, dst[:0])
	if err != nil {
		return fmt.Errorf("%w: zstd decode: %w", errdefs.ErrCorrupt, err)
	}
	if len(out) != len(dst) {
		return fmt.Errorf("%w: zstd decode: got %d bytes, want %d", errdefs.ErrCorrupt, len(out), len(dst))
	}
	// With the cap limit DecodeAll writes in place; copy should it ever not.
	if len(out) > 0 && &out[0] != &dst[0] {
		copy(dst, out)
	}
	return nil
}

// bufPool holds scratch buffers for the shuffle codecs (the shuffled copy of
// a chunk). Pointers to slices, so Put does not allocate.
var bufPool sync.Pool

// getBuf returns a scratch buffer of length n.
func getBuf(n int) *[]byte {
	if p, ok := bufPool.Get().(*[]byte); ok {
		if cap(*p) >= n {
			*p = (*p)[:n]
			return p
		}
	}
	b := make([]byte, n)
	return &b
}

func putBuf(p *[]byte) { bufPool.Put(p) }
