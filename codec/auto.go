package codec

import (
	"math"
	"sync"
)

// The "auto" choice. It must cost little next to the codec it picks, so it
// looks at a few small samples of the chunk (64 KiB of a 4 MiB chunk) and
// measures two things:
//
//   - order-0 byte entropy, of all sampled bytes (h1) and of the byte planes
//     for element sizes 2 and 4 (h2, h4: the mean over the planes). Entropy
//     in bits per byte predicts what an entropy coder (zstd's Huffman stage)
//     gets from data without repeats: 8/h is the expected ratio. When the
//     plane entropy is well below h1, the bytes of each element position
//     are skewed differently (sign/exponent vs. mantissa bytes of floats) and
//     the byte-plane shuffle pays.
//   - the LZ4 ratio of the samples: how much repetition there is.
//
// Then, in order:
//
//  1. All samples look like noise (h1 and the plane entropies near 8 bits):
//     store raw without trying a codec (compressed, encrypted data).
//  2. Float-like: the better plane entropy hs predicts a ratio at least 8%
//     better than h1 and at least 10% better than LZ4 found: shuffle+zstd,
//     with element size 2 unless 4 is clearly better (bf16 data looks the
//     same with 4-byte planes; fp32 only shows at 4).
//  3. No repeats (LZ4 gains < 2%): if entropy coding should gain >= 3%,
//     zstd as a literal-only frame (litFrame), else store raw.
//  4. Otherwise zstd at its fastest level. On text and memory pages it runs
//     at about 0.8x the speed of LZ4 and stores 20-26% fewer bytes (see
//     BenchmarkEncode); spec "lz4" remains for who wants the speed.
//
// The zstd stage of rules 2 and 3 writes literal-only frames when the
// samples show no repeats (LZ4 gains < 10%): Huffman alone gets all there is
// to get from such data, several times faster than LZ matching (litframe.go).
//
// The chunk is still encoded in full afterwards, and stored raw when not
// smaller, so a wrong guess costs time or ratio, never correctness.

const (
	sampleLen  = 16 << 10 // bytes per sample
	numSamples = 4        // samples per chunk, evenly spread
	// noiseEntropy: above this (bits/byte), in every view, data is noise.
	// Sampling 16 KiB of uniform random bytes reads about 7.99.
	noiseEntropy = 7.95
	// minSampled: smaller chunks go straight to zstd.
	minSampled = 4 << 10
	// litMaxLZ4: below this sampled LZ4 ratio, data has too few repeats for
	// LZ matching to pay, and zstd stages write literal-only frames.
	litMaxLZ4 = 1.1
)

// stats are the sample statistics of a chunk.
type stats struct {
	h1, h2, h4 float64 // entropy, bits per byte: all bytes; mean of 2 and of 4 planes
	lz4Ratio   float64 // sampled bytes / lz4 size of the samples; 0 if not measured
}

// samples returns the regions of raw that the chooser looks at: all of raw
// when small, else numSamples regions of sampleLen spread over it, at offsets
// that are multiples of 64 so each sample starts on an element boundary.
func samples(raw []byte, into *[numSamples][]byte) [][]byte {
	if len(raw) <= numSamples*sampleLen {
		into[0] = raw
		return into[:1]
	}
	span := len(raw) - sampleLen
	for i := range numSamples {
		off := (span * i / (numSamples - 1)) &^ 63
		into[i] = raw[off : off+sampleLen]
	}
	return into[:]
}

// histogram computes the entropy part of stats over the samples of raw.
func histogram(raw []byte) stats {
	var regions [numSamples][]byte
	// One table per byte position mod 4; the planes of size 2 and the whole
	// histogram are sums of these. Four tables also keep consecutive bytes
	// from stalling on the same counter.
	var h [4][256]uint32
	for _, s := range samples(raw, &regions) {
		i := 0
		for ; i+8 <= len(s); i += 8 {
			b := s[i : i+8 : i+8]
			h[0][b[0]]++
			h[1][b[1]]++
			h[2][b[2]]++
			h[3][b[3]]++
			h[0][b[4]]++
			h[1][b[5]]++
			h[2][b[6]]++
			h[3][b[7]]++
		}
		for ; i < len(s); i++ {
			h[i&3][s[i]]++
		}
	}
	var sum, even, odd [256]uint32
	for c := range 256 {
		even[c] = h[0][c] + h[2][c]
		odd[c] = h[1][c] + h[3][c]
		sum[c] = even[c] + odd[c]
	}
	return stats{
		h1: entropy(&sum),
		h2: (entropy(&even) + entropy(&odd)) / 2,
		h4: (entropy(&h[0]) + entropy(&h[1]) + entropy(&h[2]) + entropy(&h[3])) / 4,
	}
}

// entropy is the order-0 Shannon entropy of a histogram, bits per symbol.
func entropy(h *[256]uint32) float64 {
	var n uint64
	for _, c := range h {
		n += uint64(c)
	}
	if n == 0 {
		return 0
	}
	// H = log2(n) - sum(c*log2(c))/n
	var s float64
	for _, c := range h {
		if c > 1 {
			f := float64(c)
			s += f * math.Log2(f)
		}
	}
	return math.Log2(float64(n)) - s/float64(n)
}

// lz4Probe is a pooled compressor plus room for one compressed sample.
type lz4Probe struct {
	t   lz4Table
	buf [numSamples * sampleLen]byte
}

var lz4Probes = sync.Pool{New: func() any { return new(lz4Probe) }}

// lz4SampleRatio compresses the samples of raw with LZ4 and returns
// sampled bytes / compressed bytes (1 when nothing compresses).
func lz4SampleRatio(raw []byte) float64 {
	var regions [numSamples][]byte
	p := lz4Probes.Get().(*lz4Probe)
	defer lz4Probes.Put(p)
	in, out := 0, 0
	for _, s := range samples(raw, &regions) {
		in += len(s)
		// A buffer of len(s) holds any output smaller than the input.
		n := p.t.compress(s, p.buf[:len(s)])
		if n == 0 {
			n = len(s)
		}
		out += n
	}
	if out == 0 {
		return 1
	}
	return float64(in) / float64(out)
}

// shuffleID picks the element size whose planes have the lower entropy,
// preferring 2 unless 4 is clearly better.
func shuffleID(st stats) ID {
	if st.h4 < st.h2-0.05 {
		return Shuffle4Zstd
	}
	return Shuffle2Zstd
}

// planShuffle is the plan for spec "shuffle": the element size from the
// plane entropies, literal-only frames unless the data repeats.
func planShuffle(raw []byte) plan {
	if len(raw) < minSampled {
		return plan{id: Shuffle2Zstd}
	}
	st := histogram(raw)
	return plan{id: shuffleID(st), lit: lz4SampleRatio(raw) < litMaxLZ4}
}

// planAuto is the "auto" decision for a chunk that is not all zero.
func planAuto(raw []byte) plan {
	if len(raw) < minSampled {
		// Too few bytes for meaningful statistics, and cheap to just try.
		return plan{id: Zstd}
	}
	st := histogram(raw)
	if st.h1 >= noiseEntropy && min(st.h2, st.h4) >= noiseEntropy {
		return plan{id: None}
	}
	st.lz4Ratio = lz4SampleRatio(raw)
	return st.choose()
}

// choose applies rules 2-4 of the comment at the top of this file.
func (st stats) choose() plan {
	lit := st.lz4Ratio < litMaxLZ4
	id := shuffleID(st)
	hs := st.h2
	if id == Shuffle4Zstd {
		hs = st.h4
	}
	switch {
	case hs > 0 && st.h1 >= 1.08*hs && 8/hs >= 1.1*st.lz4Ratio:
		return plan{id: id, lit: lit}
	case st.lz4Ratio < 1.02:
		if 8/st.h1 >= 1.03 {
			return plan{id: Zstd, lit: true}
		}
		return plan{id: None}
	}
	return plan{id: Zstd}
}
