package codec

// CRC-32C of a concatenation from the CRCs of its parts, without their
// bytes (zlib's crc32_combine, for the Castagnoli polynomial). A CRC is
// the message's polynomial times x^32 modulo P (bit-reflected, with the
// register preset and inverted around it, which cancels out here), so
// crc(a‖b) = crc(a)·x^(8·len(b)) mod P ⊕ crc(b). Multiplying by a fixed
// power of x is linear over GF(2): for one length it is four 256-entry
// tables, one per byte of crc(a), which is what ChecksumCombiner keeps.
// The content-defined cutter computes each page's CRC for its cut
// decision; it joins them into the chunk's CRC this way instead of
// running the CRC over the chunk's bytes a second time.

// castagnoliReflected is the CRC-32C polynomial, bit-reflected.
const castagnoliReflected = 0x82f63b78

// mulModP is a·b modulo P, both reflected: bit 31 is x^0.
func mulModP(a, b uint32) uint32 {
	var p uint32
	for m := uint32(1) << 31; m != 0; m >>= 1 {
		if a&m != 0 {
			p ^= b
		}
		if b&1 != 0 {
			b = b>>1 ^ castagnoliReflected
		} else {
			b >>= 1
		}
	}
	return p
}

// xPow8n is x^(8·n) modulo P: square-and-multiply over n's bits.
func xPow8n(n uint64) uint32 {
	p := uint32(1) << 31        // x^0
	sq := uint32(1) << (31 - 8) // x^8, then x^16, x^32, ...
	for ; n != 0; n >>= 1 {
		if n&1 != 0 {
			p = mulModP(sq, p)
		}
		sq = mulModP(sq, sq)
	}
	return p
}

// CombineChecksum is the CRC-32C of a followed by b, from crcA =
// Checksum(a), crcB = Checksum(b) and lenB = len(b).
func CombineChecksum(crcA, crcB uint32, lenB int64) uint32 {
	return mulModP(xPow8n(uint64(lenB)), crcA) ^ crcB
}

// ZeroChecksum is the CRC-32C of n zero bytes, combined from those of
// runs of 1, 2, 4, ... zeros: no bytes needed.
func ZeroChecksum(n int64) uint32 {
	var crc uint32             // of no bytes
	run := Checksum([]byte{0}) // of k zeros
	for k := int64(1); n > 0; k, n = 2*k, n>>1 {
		if n&1 != 0 {
			crc = CombineChecksum(crc, run, k)
		}
		run = CombineChecksum(run, run, k)
	}
	return crc
}

// ChecksumCombiner is CombineChecksum for one length of b, by table
// (a few nanoseconds a call).
type ChecksumCombiner struct {
	t [4][256]uint32
}

// NewChecksumCombiner prepares CombineChecksum for parts b of n bytes.
func NewChecksumCombiner(n int64) *ChecksumCombiner {
	op := xPow8n(uint64(n))
	c := &ChecksumCombiner{}
	for k := range c.t {
		for v := range 256 {
			c.t[k][v] = mulModP(op, uint32(v)<<(8*k))
		}
	}
	return c
}

// Combine is CombineChecksum(crcA, crcB, n) for the combiner's n.
func (c *ChecksumCombiner) Combine(crcA, crcB uint32) uint32 {
	return c.t[0][byte(crcA)] ^ c.t[1][byte(crcA>>8)] ^ c.t[2][byte(crcA>>16)] ^ c.t[3][crcA>>24] ^ crcB
}
