package codec

import (
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
	for _, n := range lengths {
		if got, want := contentHash(buf[:n]), blake3.Sum256(buf[:n]); got != want {
			t.Errorf("length %d: contentHash %x, BLAKE3-256 %x", n, got, want)
		}
		h := blake3.New(32, key[:])
		h.Write(buf[:n])
		var want [32]byte
		h.Sum(want[:0])
		if got := KeyedHash(&key, buf[:n]); got != want {
			t.Errorf("length %d: KeyedHash %x, keyed BLAKE3-256 %x", n, got, want)
		}
	}
}
