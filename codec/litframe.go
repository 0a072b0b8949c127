package codec

import (
	"encoding/binary"
	"sync"

	"github.com/klauspost/compress/huff0"
)

// Literal-only zstd frames.
//
// On byte planes of float tensors (and other data without repeats but with a
// skewed byte distribution) all of zstd's gain comes from its Huffman stage:
// LZ matches in a plane of 3-bit exponent symbols are short and barely pay
// for their offsets, yet finding and coding them is where the fastest zstd
// level spends about 90% of its time. litFrame writes a standard zstd frame
// (RFC 8878) whose blocks carry Huffman-coded literals and zero sequences, or
// are stored raw when Huffman does not pay, so any zstd decoder reads it and
// the codec ids stay as they are. It is several times faster than EncodeAll
// on such data and stores about as few bytes.

const (
	zstdMagic    = 0xFD2FB528
	zstdBlockMax = 128 << 10 // largest block zstd allows

	blockRaw        = 0
	blockRLE        = 1
	blockCompressed = 2
	litCompressed   = 2 // Literals_Block_Type: Huffman with its own tree

	// litWantLogLess: keep a Huffman block only if it saves at least 1/32
	// (3%) of the block; for less, a raw block decodes faster (a memcpy).
	litWantLogLess = 5
)

var huffScratch = sync.Pool{New: func() any { return new(huff0.Scratch) }}

// litFrame appends to dst one zstd frame that decodes to src.
func litFrame(dst, src []byte) []byte {
	dst = appendFrameHeader(dst, len(src))
	if len(src) == 0 {
		return appendBlockHeader(dst, true, blockRaw, 0)
	}
	s := huffScratch.Get().(*huff0.Scratch)
	defer huffScratch.Put(s)
	for len(src) > 0 {
		blk := src[:min(len(src), zstdBlockMax)]
		src = src[len(blk):]
		dst = appendLitBlock(dst, blk, len(src) == 0, s)
	}
	return dst
}

// appendFrameHeader writes magic and a single-segment frame header with the
// content size (the window is then the content size, at most MaxChunk) and
// no checksum: chunks carry their own CRC-32C.
func appendFrameHeader(b []byte, n int) []byte {
	b = binary.LittleEndian.AppendUint32(b, zstdMagic)
	const single = 1 << 5
	switch {
	case n < 256:
		return append(b, single|0<<6, byte(n))
	case n < 65536+256:
		return binary.LittleEndian.AppendUint16(append(b, single|1<<6), uint16(n-256))
	case uint64(n) <= 0xFFFFFFFF:
		return binary.LittleEndian.AppendUint32(append(b, single|2<<6), uint32(n))
	}
	return binary.LittleEndian.AppendUint64(append(b, single|3<<6), uint64(n))
}

func appendBlockHeader(b []byte, last bool, typ, size int) []byte {
	h := uint32(size)<<3 | uint32(typ)<<1
	if last {
		h |= 1
	}
	return append(b, byte(h), byte(h>>8), byte(h>>16))
}

// appendLitBlock appends one block holding blk: Huffman-coded literals and no
// sequences, or raw, or RLE, whichever the data allows.
func appendLitBlock(dst, blk []byte, last bool, s *huff0.Scratch) []byte {
	s.Reuse = huff0.ReusePolicyNone // each block carries its own tree
	s.WantLogLess = litWantLogLess
	var (
		out    []byte
		err    error
		single bool
	)
	switch {
	case len(blk) >= 1024: // 4 streams need enough input
		out, _, err = huff0.Compress4X(blk, s)
	case len(blk) > 16:
		single = true
		out, _, err = huff0.Compress1X(blk, s)
	default:
		err = huff0.ErrIncompressible
	}
	if err == huff0.ErrUseRLE {
		return append(appendBlockHeader(dst, last, blockRLE, len(blk)), blk[0])
	}
	if err == nil {
		lh := litHeaderSize(len(out), len(blk), single)
		if size := lh + len(out) + 1; size < len(blk) {
			dst = appendBlockHeader(dst, last, blockCompressed, size)
			dst = appendLitHeader(dst, len(out), len(blk), single)
			dst = append(dst, out...)
			return append(dst, 0) // Number_of_Sequences = 0
		}
	}
	// Incompressible (or any other huff0 refusal): store the block raw.
	return append(appendBlockHeader(dst, last, blockRaw, len(blk)), blk...)
}

// litHeaderSize is the size of a Compressed_Literals_Block header.
func litHeaderSize(comp, regen int, single bool) int {
	switch {
	case comp < 1<<10 && regen < 1<<10:
		return 3
	case comp < 1<<14 && regen < 1<<14 && !single:
		return 4
	}
	return 5
}

// appendLitHeader writes the Literals_Section_Header: type, Size_Format,
// Regenerated_Size and Compressed_Size (tree description included), little
// endian bit fields as RFC 8878 section 3.1.1.3.1.1 lays them out.
func appendLitHeader(b []byte, comp, regen int, single bool) []byte {
	h := uint64(litCompressed) | uint64(regen)<<4
	switch litHeaderSize(comp, regen, single) {
	case 3:
		if !single {
			h |= 1 << 2 // Size_Format 01: 4 streams, 10-bit sizes
		}
		h |= uint64(comp) << 14
		return append(b, byte(h), byte(h>>8), byte(h>>16))
	case 4:
		h |= 2<<2 | uint64(comp)<<18
		return binary.LittleEndian.AppendUint32(b, uint32(h))
	}
	h |= 3<<2 | uint64(comp)<<22
	return append(binary.LittleEndian.AppendUint32(b, uint32(h)), byte(h>>32))
}
