package codec

// BLAKE3 of one chunk on the calling goroutine.
//
// lukechampine.com/blake3's Sum256 hashes a large input by starting one
// goroutine per 16 KiB subtree: 256 goroutines for a 4 MiB chunk, whose
// creation, scheduling and stacks cost a fifth of the hashing itself, on
// top of the pipeline's own workers that already hash many chunks at once.
// contentHash walks the same tree serially with the same SIMD kernels
// (16 chunks of 1 KiB per call), so the result is bit for bit BLAKE3-256.

import (
	"encoding/binary"
	"math/bits"

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
	for len(b) > group {
		// counter stays a multiple of MaxSIMD here: each group is a
		// complete subtree of height log2(MaxSIMD).
		n := guts.CompressBuffer((*[group]byte)(b), group, key, counter, flags)
		push(guts.ChainingValue(n), bits.TrailingZeros(guts.MaxSIMD))
		b = b[group:]
	}
	// The last group on the SIMD kernel too, not chunk by chunk in Go:
	// content-defined chunks end anywhere in a group, and a 320 KiB one
	// took 1.35x as long with its last group in Go (BenchmarkContentHash).
	// The kernel reads a whole group: a short one is copied into one.
	var n guts.Node
	switch {
	case len(b) == group:
		n = guts.CompressBuffer((*[group]byte)(b), group, key, counter, flags)
	case len(b) <= guts.ChunkSize:
		n = guts.CompressChunk(b, key, counter, flags)
	default:
		var last [group]byte
		copy(last[:], b)
		n = guts.CompressBuffer(&last, len(b), key, counter, flags)
	}
	for i := bits.TrailingZeros64(counter); i < bits.Len64(counter); i++ {
		if counter&(1<<i) != 0 {
			n = guts.ParentNode(stack[i], guts.ChainingValue(n), key, flags)
		}
	}
	n.Flags |= guts.FlagRoot
	out := guts.WordsToBytes(guts.CompressNode(n))
	var h [32]byte
	copy(h[:], out[:32])
	return h
}
