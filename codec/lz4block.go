package codec

// An LZ4 block encoder for whole chunks. pierrec/lz4's Compressor is built
// for the frame format's 64 KiB blocks: it keeps 16-bit positions and a
// bitmap of the table entries in use, so that a table is cheap to reset
// between small blocks, and it pays for that with a dependent load at every
// probe and a read-modify-write of the bitmap at every insert; on text that
// was 40% of the encoder's time. Chunks are megabytes. Here the table holds
// 32-bit positions plus a base that moves on by the input's length and a
// whole window after every input, so an entry left by an earlier input, or
// never written, always lies more than the 64 KiB window back and is
// refused by the same offset test that refuses a match too far away:
// nothing is reset and nothing is marked.
//
// The search is the one pierrec/lz4 makes (three positions per 8-byte load,
// a 16-bit hash of 6 bytes, skipping faster the longer nothing matched), so
// the ratio is pierrec's (to 0.01% on the benchmark's text and pages:
// TestLZ4BlockRatio); the output is a plain LZ4 block that any LZ4 decoder
// reads (the codec's own decoder is pierrec/lz4's). Inputs are chunks, at
// most codec.MaxChunk bytes, so positions fit in 32 bits.

import (
	"encoding/binary"
	"math"
	"math/bits"
)

const (
	lz4HashLog   = 16
	lz4MinMatch  = 4
	lz4MaxOffset = 1<<16 - 1
	// The block format wants the last match to start at least 12 bytes
	// before the end and the last 5 bytes to be literals.
	lz4MFLimit      = 12
	lz4LastLiterals = 5
	// lz4SkipLog: after 2^lz4SkipLog bytes without a match the search steps
	// one more byte at a time, so incompressible data is crossed quickly.
	lz4SkipLog = 7
)

// lz4Table is an encoder's match table; it is reused from input to input.
type lz4Table struct {
	pos  [1 << lz4HashLog]uint32 // base + position of the last 6 bytes hashed there
	base int
}

func lz4Hash(x uint64) uint32 {
	const prime6bytes = 227718039650203
	return uint32(((x << 16) * prime6bytes) >> (64 - lz4HashLog))
}

func le64(b []byte) uint64 { return binary.LittleEndian.Uint64(b) }
func le32(b []byte) uint32 { return binary.LittleEndian.Uint32(b) }

// compress encodes src as one LZ4 block into dst and returns its length,
// or 0 when it would not fit in len(dst) bytes.
func (t *lz4Table) compress(src, dst []byte) int {
	// Every stored entry must stay below base after this input.
	if t.base == 0 || t.base+len(src)+lz4MaxOffset+1 > math.MaxUint32 {
		clear(t.pos[:])
		t.base = lz4MaxOffset + 1
	}
	base := t.base
	t.base += len(src) + lz4MaxOffset + 1

	si, di, anchor := 0, 0, 0
	sn := len(src) - lz4MFLimit // a match starts before sn
	mlimit := len(src) - lz4LastLiterals
	for si < sn {
		seq := le64(src[si:])
		h, h2 := lz4Hash(seq), lz4Hash(seq>>8)
		ref, ref2 := int(t.pos[h])-base, int(t.pos[h2])-base
		t.pos[h], t.pos[h2] = uint32(base+si), uint32(base+si+1)
		// offset in [1, lz4MaxOffset] also proves ref lies in src[:si].
		offset := si - ref
		if uint(offset-1) >= lz4MaxOffset || uint32(seq) != le32(src[ref:]) {
			h3 := lz4Hash(seq >> 16)
			ref3 := int(t.pos[h3]) - base
			si++
			offset = si - ref2
			if uint(offset-1) >= lz4MaxOffset || uint32(seq>>8) != le32(src[ref2:]) {
				si++
				offset = si - ref3
				t.pos[h3] = uint32(base + si)
				if uint(offset-1) >= lz4MaxOffset || uint32(seq>>16) != le32(src[ref3:]) {
					si += 2 + (si-anchor)>>lz4SkipLog
					continue
				}
			}
		}

		// A match of at least 4 bytes at si, offset back: extend it both ways.
		ref = si - offset
		for si > anchor && ref > 0 && src[si-1] == src[ref-1] {
			si--
			ref--
		}
		end := si + lz4MinMatch
		end += matchLen(src[end:mlimit], src[ref+lz4MinMatch:])

		lLen, mLen := si-anchor, end-si-lz4MinMatch
		if di+seqLen(lLen)+2+extLen(mLen) > len(dst) {
			return 0
		}
		tok := di
		di++
		if lLen < 15 {
			dst[tok] = byte(lLen << 4)
		} else {
			dst[tok] = 0xF0
			di = putLen(dst, di, lLen-15)
		}
		di += copy(dst[di:], src[anchor:si])
		dst[di], dst[di+1] = byte(offset), byte(offset>>8)
		di += 2
		if mLen < 15 {
			dst[tok] |= byte(mLen)
		} else {
			dst[tok] |= 0x0F
			di = putLen(dst, di, mLen-15)
		}
		si, anchor = end, end
		if si >= sn {
			break
		}
		t.pos[lz4Hash(le64(src[si-2:]))] = uint32(base + si - 2)
	}

	lLen := len(src) - anchor
	if di+seqLen(lLen) > len(dst) {
		return 0
	}
	if lLen < 15 {
		dst[di] = byte(lLen << 4)
		di++
	} else {
		dst[di] = 0xF0
		di = putLen(dst, di+1, lLen-15)
	}
	return di + copy(dst[di:], src[anchor:])
}

// matchLen is the length of the common prefix of a and b (len(b) >= len(a)).
func matchLen(a, b []byte) int {
	b = b[:len(a)]
	i := 0
	for ; i+8 <= len(a); i += 8 {
		if x := le64(a[i:i+8]) ^ le64(b[i:i+8]); x != 0 {
			return i + bits.TrailingZeros64(x)>>3
		}
	}
	for ; i < len(a); i++ {
		if a[i] != b[i] {
			break
		}
	}
	return i
}

// extLen is how many bytes follow the token for a length n (of literals,
// or of a match beyond its 4 bytes): none when it fits the token's 4 bits.
func extLen(n int) int {
	if n < 15 {
		return 0
	}
	return (n-15)/255 + 1
}

// seqLen is the size of a token and n literals.
func seqLen(n int) int { return 1 + extLen(n) + n }

// putLen writes the rest n of a length that overflowed its 4-bit field as
// LZ4 does: 255s, then the remainder.
func putLen(dst []byte, di, n int) int {
	for ; n >= 255; n -= 255 {
		dst[di] = 255
		di++
	}
	dst[di] = byte(n)
	return di + 1
}
