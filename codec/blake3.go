package codec

// BLAKE3 of one chunk on the calling goroutine.
//
// lukechampine.com/blake3's Sum256 hashes a large input by starting one
// goroutine per 16 KiB subtree: 256 goroutines for a 4 MiB chunk, whose
// creation, scheduling and stacks cost a fifth of the hashing itself, on
// top of the pipeline's own workers that already hash many chunks at once.
// contentHash walks the same tree serially with the same SIMD kernels
// (16 chunks of 1 KiB per call), so the result is bit for bit BLAKE3-256.
//
// Where the CPU has AVX-512, the tree is hashed by kernels of our own
// (blake3_amd64.s, generated): the library's merges every group of 16
// chunks into its root at once, 8 parents a call on AVX2 whether 8, 4 or 2
// are left, then the groups' roots one at a time in Go, which together
// cost a quarter of the hashing (CPU profile of BenchmarkContentHash).
// Ours keep the chaining values of a whole level in word-major blocks of
// 16 and reduce it 16 parents a call, level by level (pairs, the odd one
// carried up: the same tree as BLAKE3's, whose left subtrees are full).

//go:generate go run blake3_amd64_gen.go

import (
	"encoding/binary"
	"math/bits"
	"sync"

	"lukechampine.com/blake3"
	"lukechampine.com/blake3/guts"
)

// group is what one SIMD call compresses: MaxSIMD chunks.
const group = guts.MaxSIMD * guts.ChunkSize

func contentHash(b []byte) [32]byte {
	if len(b) <= guts.ChunkSize {
		return blake3.Sum256(b) // one chunk: no goroutines there either
	}
	return treeHash(b, &guts.IV, 0)
}

// KeyedHash is BLAKE3-256 in keyed mode (what blake3.New(32, key) gives),
// on the calling goroutine like ContentHash.
func KeyedHash(key *[32]byte, b []byte) [32]byte {
	if len(b) <= guts.ChunkSize {
		h := blake3.New(32, key[:])
		h.Write(b)
		var out [32]byte
		h.Sum(out[:0])
		return out
	}
	var kw [8]uint32
	for i := range kw {
		kw[i] = binary.LittleEndian.Uint32(key[4*i:])
	}
	return treeHash(b, &kw, guts.FlagKeyedHash)
}

// treeHash hashes b (more than one chunk) with key words key and mode
// flags, serially.
func treeHash(b []byte, key *[8]uint32, flags uint32) [32]byte {
	if haveAVX512 && len(b) <= maxTree16 {
		return treeHash16(b, key, flags)
	}
	return serialTreeHash(len(b), func(off int) []byte { return b[off:] }, key, flags)
}

// zeroGroup is one group of zero bytes: the hash of n zeros reads it
// again and again, not n bytes of memory.
var zeroGroup [group]byte

// ZeroHash is ContentHash of n zero bytes, from one group of zeros.
func ZeroHash(n int) [32]byte {
	if n <= group {
		return contentHash(zeroGroup[:n])
	}
	return serialTreeHash(n, func(int) []byte { return zeroGroup[:] }, &guts.IV, 0)
}

// KeyedZeroHash is KeyedHash of n zero bytes, from one group of zeros.
func KeyedZeroHash(key *[32]byte, n int) [32]byte {
	if n <= group {
		return KeyedHash(key, zeroGroup[:n])
	}
	var kw [8]uint32
	for i := range kw {
		kw[i] = binary.LittleEndian.Uint32(key[4*i:])
	}
	return serialTreeHash(n, func(int) []byte { return zeroGroup[:] }, &kw, guts.FlagKeyedHash)
}

// serialTreeHash hashes n bytes (more than one chunk) group by group:
// at(off) returns the bytes from offset off on, at least a group's or
// what is left of the n.
func serialTreeHash(n int, at func(off int) []byte, key *[8]uint32, flags uint32) [32]byte {
	var (
		stack   [64][8]uint32
		counter uint64 // chunks hashed; its set bits say which stack slots hold a subtree
	)
	push := func(cv [8]uint32, height int) {
		i := height
		for counter&(1<<i) != 0 {
			cv = guts.ChainingValue(guts.ParentNode(stack[i], cv, key, flags))
			i++
		}
		stack[i] = cv
		counter += 1 << height
	}
	// Every group but the last (1 to MaxSIMD chunks), whose node is the
	// rightmost subtree, completed below.
	off := 0
	for ; n-off > group; off += group {
		// counter stays a multiple of MaxSIMD here: each group is a
		// complete subtree of height log2(MaxSIMD).
		node := guts.CompressBuffer((*[group]byte)(at(off)), group, key, counter, flags)
		push(guts.ChainingValue(node), bits.TrailingZeros(guts.MaxSIMD))
	}
	// The last group on the SIMD kernel too, not chunk by chunk in Go:
	// content-defined chunks end anywhere in a group, and a 320 KiB one
	// took 1.35x as long with its last group in Go (BenchmarkContentHash).
	// The kernel reads a whole group: a short one is copied into one.
	b := at(off)[:n-off]
	var node guts.Node
	switch {
	case len(b) == group:
		node = guts.CompressBuffer((*[group]byte)(b), group, key, counter, flags)
	case len(b) <= guts.ChunkSize:
		node = guts.CompressChunk(b, key, counter, flags)
	default:
		var last [group]byte
		copy(last[:], b)
		node = guts.CompressBuffer(&last, len(b), key, counter, flags)
	}
	for i := bits.TrailingZeros64(counter); i < bits.Len64(counter); i++ {
		if counter&(1<<i) != 0 {
			node = guts.ParentNode(stack[i], guts.ChainingValue(node), key, flags)
		}
	}
	return rootHash(node)
}

// rootHash is the 32-byte hash of the tree whose root node is n.
func rootHash(n guts.Node) [32]byte {
	n.Flags |= guts.FlagRoot
	out := guts.WordsToBytes(guts.CompressNode(n))
	var h [32]byte
	copy(h[:], out[:32])
	return h
}

// maxTree16 bounds what treeHash16 takes: its chunk counters are 32 bits,
// and chunks are far smaller (MaxChunk).
const maxTree16 = 1 << 40

// level holds one level of the tree: chaining values in word-major blocks
// of 16, with room for the pair of blocks a last parent call reads.
type level [][8][16]uint32

var levels = sync.Pool{New: func() any { return new(level) }}

func (l level) cv(i int) (cv [8]uint32) {
	for w := range cv {
		cv[w] = l[i/16][w][i%16]
	}
	return cv
}

func (l level) setCV(i int, cv [8]uint32) {
	for w, x := range cv {
		l[i/16][w][i%16] = x
	}
}

// treeHash16 is treeHash on the AVX-512 kernels.
func treeHash16(b []byte, key *[8]uint32, flags uint32) [32]byte {
	n := (len(b) + guts.ChunkSize - 1) / guts.ChunkSize // chunks: 2 or more
	lp := levels.Get().(*level)
	defer levels.Put(lp)
	if blocks := (n+31)/32*2 + 2; cap(*lp) < blocks {
		*lp = make(level, blocks)
	}
	l := (*lp)[:cap(*lp)]
	full := len(b) / group
	for g := range full {
		hashChunks16(&l[g], (*[group]byte)(b[g*group:]), key, uint32(g*guts.MaxSIMD), flags)
	}
	if rest := b[full*group:]; len(rest) > 0 {
		whole := len(rest) / guts.ChunkSize
		if whole > 0 {
			// The last group's whole chunks, in a group of their own
			// (the kernel reads 16); lanes past them are not used.
			var last [group]byte
			copy(last[:], rest[:whole*guts.ChunkSize])
			hashChunks16(&l[full], &last, key, uint32(full*guts.MaxSIMD), flags)
		}
		if tail := rest[whole*guts.ChunkSize:]; len(tail) > 0 {
			c := full*guts.MaxSIMD + whole
			l.setCV(c, guts.ChainingValue(guts.CompressChunk(tail, key, uint64(c), flags)))
		}
	}
	for ; n > 2; n = (n + 1) / 2 {
		var odd [8]uint32
		if n%2 == 1 {
			odd = l.cv(n - 1) // before the calls write over its block
		}
		for o := 0; o*16 < n/2; o++ {
			hashParents16(&l[o], (*[2][8][16]uint32)(l[2*o:]), key, flags)
		}
		if n%2 == 1 {
			l.setCV(n/2, odd)
		}
	}
	return rootHash(guts.ParentNode(l.cv(0), l.cv(1), key, flags))
}
