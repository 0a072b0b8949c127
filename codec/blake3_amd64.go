//go:build amd64 && !purego

package codec

import "golang.org/x/sys/cpu"

// haveAVX512 selects the 16-lane kernels of blake3_amd64.s (a variable for
// the tests, which check both paths).
var haveAVX512 = cpu.X86.HasAVX512F

// hashChunks16 compresses the 16 whole chunks of buf, chunk i with counter
// counter+i, into their chaining values, word-major.
//
//go:noescape
func hashChunks16(cvs *[8][16]uint32, buf *[group]byte, key *[8]uint32, counter uint32, flags uint32)

// hashParents16 compresses the parents of the 32 chaining values of in
// (word-major: the first block's 16, then the second's), pairwise, into
// out; out may be in[0].
//
//go:noescape
func hashParents16(out *[8][16]uint32, in *[2][8][16]uint32, key *[8]uint32, flags uint32)
