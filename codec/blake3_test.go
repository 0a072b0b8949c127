package codec

import (
	"bytes"
	"math/rand/v2"
	"testing"

	"lukechampine.com/blake3"
)

// contentHash must be BLAKE3-256, whatever the length: around chunk (1 KiB)
// and SIMD group (16 KiB) boundaries, and at chunk sizes the writer uses.
func TestContentHashIsBLAKE3(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	buf := make([]byte, 4<<20+3)
	for i := range buf {
		buf[i] = byte(r.Uint32())
	}
	lengths := []int{0, 1, 63, 64, 65, 1023, 1024, 1025, 2047, 2048, 2049, 3 << 10, 16<<10 - 1, 16 << 10, 16<<10 + 1,
		17 << 10, 4 << 10, 12 << 10, 20 << 10, 28 << 10, 32 << 10, 332 << 10, 32<<10 + 5, 31 << 10, 48<<10 - 1, 64 << 10, 100000, 1 << 20, 1<<20 + 1024, 4<<20 - 1, 4 << 20, 4<<20 + 3}
	for range 40 {
		lengths = append(lengths, r.IntN(len(buf)+1))
	}
	var key [32]byte
	for i := range key {
		key[i] = byte(r.Uint32())
	}
	for kernels := range hashKernels() {
		for _, n := range lengths {
			if got, want := contentHash(buf[:n]), blake3.Sum256(buf[:n]); got != want {
				t.Errorf("%s, length %d: contentHash %x, BLAKE3-256 %x", kernels, n, got, want)
			}
			h := blake3.New(32, key[:])
			h.Write(buf[:n])
			var want [32]byte
			h.Sum(want[:0])
			if got := KeyedHash(&key, buf[:n]); got != want {
				t.Errorf("%s, length %d: KeyedHash %x, keyed BLAKE3-256 %x", kernels, n, got, want)
			}
		}
	}
}

// hashKernels runs the hashing on each set of kernels this CPU has, one
// after the other, naming each, and leaves the best on.
func hashKernels() func(yield func(string) bool) {
	return func(yield func(string) bool) {
		avx512 := haveAVX512
		defer func() { haveAVX512 = avx512 }()
		haveAVX512 = false
		if !yield("library kernels") || !avx512 {
			return
		}
		haveAVX512 = true
		yield("AVX-512 kernels")
	}
}

// FuzzContentHash: any input hashes to its BLAKE3-256, keyed too.
func FuzzContentHash(f *testing.F) {
	f.Add([]byte("x"), 0)
	f.Add(make([]byte, 16<<10), 1)
	f.Add(make([]byte, 33<<10+1), 3)
	f.Fuzz(func(t *testing.T, b []byte, repeat int) {
		// Repeated, to reach sizes of many groups and levels.
		b = bytes.Repeat(b, 1+max(repeat, -repeat)%16)
		key := blake3.Sum256(b[:min(len(b), 5)])
		for kernels := range hashKernels() {
			if got, want := contentHash(b), blake3.Sum256(b); got != want {
				t.Fatalf("%s, %d bytes: contentHash %x, BLAKE3-256 %x", kernels, len(b), got, want)
			}
			h := blake3.New(32, key[:])
			h.Write(b)
			var want [32]byte
			h.Sum(want[:0])
			if got := KeyedHash(&key, b); got != want {
				t.Fatalf("%s, %d bytes: KeyedHash %x, keyed BLAKE3-256 %x", kernels, len(b), got, want)
			}
		}
	})
}
