package codec

import "encoding/binary"

// Byte-plane shuffle. Tensors of bf16/fp16/fp32 compress badly as they are:
// the sign and exponent bytes repeat a few values while the mantissa bytes
// look random, and the two are interleaved, so neither LZ matching nor a
// byte-wise entropy coder sees the skew. Gathering byte j of every element
// into plane j puts the low-entropy bytes next to each other, where zstd's
// Huffman stage codes them in a few bits each.
//
// Layout for element size k and n = len/k elements: plane j (0 <= j < k)
// holds byte j of elements 0..n-1, planes in order, then the len%k tail bytes
// unshuffled.
//
// The kernels move 8 elements per step through 64-bit registers (one load or
// store per 8 bytes, shifts and masks in between) instead of byte by byte.
// They touch k+1 sequential streams, which the hardware prefetcher follows, so
// no extra cache blocking is needed.

// shuffle writes the byte planes of src (element size k) into dst;
// len(dst) == len(src).
func shuffle(dst, src []byte, k int) {
	switch k {
	case 2:
		shuffle2(dst, src)
	case 4:
		shuffle4(dst, src)
	default:
		shuffleGeneric(dst, src, k)
	}
}

// unshuffle is the inverse of shuffle: src holds planes, dst gets elements.
func unshuffle(dst, src []byte, k int) {
	switch k {
	case 2:
		unshuffle2(dst, src)
	case 4:
		unshuffle4(dst, src)
	default:
		unshuffleGeneric(dst, src, k)
	}
}

// shuffleGeneric is the byte-at-a-time reference, also used for the last few
// elements of the fast kernels.
func shuffleGeneric(dst, src []byte, k int) {
	n := len(src) / k
	for j := range k {
		p := dst[j*n : (j+1)*n]
		for i := range p {
			p[i] = src[i*k+j]
		}
	}
	copy(dst[n*k:], src[n*k:])
}

func unshuffleGeneric(dst, src []byte, k int) {
	n := len(dst) / k
	for j := range k {
		p := src[j*n : (j+1)*n]
		for i, b := range p {
			dst[i*k+j] = b
		}
	}
	copy(dst[n*k:], src[n*k:])
}

// evens packs bytes 0, 2, 4, 6 of x into the low 32 bits.
func evens(x uint64) uint64 {
	x &= 0x00ff00ff00ff00ff
	x = (x | x>>8) & 0x0000ffff0000ffff
	return (x | x>>16) & 0x00000000ffffffff
}

// spread is the inverse of evens: the 4 bytes of x go to bytes 0, 2, 4, 6.
func spread(x uint32) uint64 {
	v := uint64(x)
	v = (v | v<<16) & 0x0000ffff0000ffff
	return (v | v<<8) & 0x00ff00ff00ff00ff
}

// interleave returns the bytes of a and b alternating: a0 b0 a1 b1 ...
func interleave(a, b uint32) uint64 { return spread(a) | spread(b)<<8 }

// The kernels below walk their slices by reslicing, with the lengths in the
// loop condition, so that the compiler drops all bounds checks in the loop.

func shuffle2(dst, src []byte) {
	n := len(src) / 2
	p0, p1 := dst[:n], dst[n:2*n]
	s := src[:2*n]
	for len(s) >= 16 && len(p0) >= 8 && len(p1) >= 8 {
		a := binary.LittleEndian.Uint64(s[0:8])
		b := binary.LittleEndian.Uint64(s[8:16])
		binary.LittleEndian.PutUint64(p0[:8], evens(a)|evens(b)<<32)
		binary.LittleEndian.PutUint64(p1[:8], evens(a>>8)|evens(b>>8)<<32)
		s, p0, p1 = s[16:], p0[8:], p1[8:]
	}
	for i := range p0 {
		p0[i], p1[i] = s[2*i], s[2*i+1]
	}
	copy(dst[2*n:], src[2*n:])
}

func unshuffle2(dst, src []byte) {
	n := len(dst) / 2
	p0, p1 := src[:n], src[n:2*n]
	d := dst[:2*n]
	for len(d) >= 16 && len(p0) >= 8 && len(p1) >= 8 {
		x := binary.LittleEndian.Uint64(p0[:8])
		y := binary.LittleEndian.Uint64(p1[:8])
		binary.LittleEndian.PutUint64(d[0:8], interleave(uint32(x), uint32(y)))
		binary.LittleEndian.PutUint64(d[8:16], interleave(uint32(x>>32), uint32(y>>32)))
		d, p0, p1 = d[16:], p0[8:], p1[8:]
	}
	for i := range p0 {
		d[2*i], d[2*i+1] = p0[i], p1[i]
	}
	copy(dst[2*n:], src[2*n:])
}

// shuffle4 is shuffle2 applied twice in registers: the even bytes of 4-byte
// elements are bytes 0 and 2, whose evens are byte 0 and odds byte 2.
func shuffle4(dst, src []byte) {
	n := len(src) / 4
	p0, p1, p2, p3 := dst[:n], dst[n:2*n], dst[2*n:3*n], dst[3*n:4*n]
	s := src[:4*n]
	for len(s) >= 32 && len(p0) >= 8 && len(p1) >= 8 && len(p2) >= 8 && len(p3) >= 8 {
		a := binary.LittleEndian.Uint64(s[0:8])
		b := binary.LittleEndian.Uint64(s[8:16])
		c := binary.LittleEndian.Uint64(s[16:24])
		d := binary.LittleEndian.Uint64(s[24:32])
		// Bytes 0,2 (e) and 1,3 (o) of elements 0-3 and 4-7.
		e03 := evens(a) | evens(b)<<32
		o03 := evens(a>>8) | evens(b>>8)<<32
		e47 := evens(c) | evens(d)<<32
		o47 := evens(c>>8) | evens(d>>8)<<32
		binary.LittleEndian.PutUint64(p0[:8], evens(e03)|evens(e47)<<32)
		binary.LittleEndian.PutUint64(p1[:8], evens(o03)|evens(o47)<<32)
		binary.LittleEndian.PutUint64(p2[:8], evens(e03>>8)|evens(e47>>8)<<32)
		binary.LittleEndian.PutUint64(p3[:8], evens(o03>>8)|evens(o47>>8)<<32)
		s, p0, p1, p2, p3 = s[32:], p0[8:], p1[8:], p2[8:], p3[8:]
	}
	for i := range p0 {
		p0[i], p1[i], p2[i], p3[i] = s[4*i], s[4*i+1], s[4*i+2], s[4*i+3]
	}
	copy(dst[4*n:], src[4*n:])
}

func unshuffle4(dst, src []byte) {
	n := len(dst) / 4
	p0, p1, p2, p3 := src[:n], src[n:2*n], src[2*n:3*n], src[3*n:4*n]
	d := dst[:4*n]
	for len(d) >= 32 && len(p0) >= 8 && len(p1) >= 8 && len(p2) >= 8 && len(p3) >= 8 {
		w0 := binary.LittleEndian.Uint64(p0[:8])
		w1 := binary.LittleEndian.Uint64(p1[:8])
		w2 := binary.LittleEndian.Uint64(p2[:8])
		w3 := binary.LittleEndian.Uint64(p3[:8])
		// Bytes 0,2 (e) and 1,3 (o) of elements 0-3 and 4-7.
		e03 := interleave(uint32(w0), uint32(w2))
		e47 := interleave(uint32(w0>>32), uint32(w2>>32))
		o03 := interleave(uint32(w1), uint32(w3))
		o47 := interleave(uint32(w1>>32), uint32(w3>>32))
		binary.LittleEndian.PutUint64(d[0:8], interleave(uint32(e03), uint32(o03)))
		binary.LittleEndian.PutUint64(d[8:16], interleave(uint32(e03>>32), uint32(o03>>32)))
		binary.LittleEndian.PutUint64(d[16:24], interleave(uint32(e47), uint32(o47)))
		binary.LittleEndian.PutUint64(d[24:32], interleave(uint32(e47>>32), uint32(o47>>32)))
		d, p0, p1, p2, p3 = d[32:], p0[8:], p1[8:], p2[8:], p3[8:]
	}
	for i := range p0 {
		d[4*i], d[4*i+1], d[4*i+2], d[4*i+3] = p0[i], p1[i], p2[i], p3[i]
	}
	copy(dst[4*n:], src[4*n:])
}
