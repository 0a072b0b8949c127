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
	var (
		stack   [64][8]uint32
		counter uint64 // chunks hashed; its set bits say which stack slots hold a subtree
	)
	push := func(cv [8]uint32, height int) {
		i := height
		for counter&(1<<i) != 0 {
			cv = guts.ChainingValue(guts.ParentNode(stack[i], cv, &guts.IV, 0))
			i++
		}
		stack[i] = cv
		counter += 1 << height
	}
	// Every chunk but the last, which becomes (part of) the root.
	last := len(b) % guts.ChunkSize
	if last == 0 {
		last = guts.ChunkSize
	}
	body, tail := b[:len(b)-last], b[len(b)-last:]
	for len(body) >= group {
		// counter stays a multiple of MaxSIMD here: each group is a
		// complete subtree of height log2(MaxSIMD).
		n := guts.CompressBuffer((*[group]byte)(body), group, &guts.IV, counter, 0)
		push(guts.ChainingValue(n), bits.TrailingZeros(guts.MaxSIMD))
		body = body[group:]
	}
	for len(body) > 0 {
		push(guts.ChainingValue(guts.CompressChunk(body[:guts.ChunkSize], &guts.IV, counter, 0)), 0)
		body = body[guts.ChunkSize:]
	}
	n := guts.CompressChunk(tail, &guts.IV, counter, 0)
	for i := bits.TrailingZeros64(counter); i < bits.Len64(counter); i++ {
		if counter&(1<<i) != 0 {
			n = guts.ParentNode(stack[i], guts.ChainingValue(n), &guts.IV, 0)
		}
	}
	n.Flags |= guts.FlagRoot
	out := guts.WordsToBytes(guts.CompressNode(n))
	var h [32]byte
	copy(h[:], out[:32])
	return h
}
