package codec

import (
	"runtime"
	"testing"

	"lukechampine.com/blake3"
)

// The sums of n zero bytes, computed without n bytes, are those of the
// bytes: around chunk (1 KiB) and group (16 KiB) boundaries, at the
// writer's chunk sizes and at MaxChunk.
func TestZeroSums(t *testing.T) {
	zeros := make([]byte, MaxChunk)
	var key [32]byte
	for i := range key {
		key[i] = byte(3 * i)
	}
	for _, n := range []int{0, 1, 7, 1023, 1024, 1025, 16<<10 - 1, 16 << 10, 16<<10 + 1, 33<<10 + 5, 100000,
		1 << 20, 4<<20 - 512, 4 << 20, 4<<20 + 3, MaxChunk - 1, MaxChunk} {
		if got, want := ZeroChecksum(int64(n)), Checksum(zeros[:n]); got != want {
			t.Errorf("ZeroChecksum(%d) = %08x, want %08x", n, got, want)
		}
		if got, want := ZeroHash(n), blake3.Sum256(zeros[:n]); got != want {
			t.Errorf("ZeroHash(%d) = %x, want %x", n, got, want)
		}
		h := blake3.New(32, key[:])
		h.Write(zeros[:n])
		var want [32]byte
		h.Sum(want[:0])
		if got := KeyedZeroHash(&key, n); got != want {
			t.Errorf("KeyedZeroHash(%d) = %x, want %x", n, got, want)
		}
	}
}

// The sums of MaxChunk zeros take no buffer of that size: the first zero
// chunk's checksum once cost 64 MiB for the life of the process.
func TestZeroSumsBounded(t *testing.T) {
	var key [32]byte
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	ZeroChecksum(MaxChunk)
	ZeroHash(MaxChunk)
	KeyedZeroHash(&key, MaxChunk)
	runtime.ReadMemStats(&after)
	if n := after.TotalAlloc - before.TotalAlloc; n > 1<<20 {
		t.Fatalf("the sums of %d zeros allocated %d bytes", MaxChunk, n)
	}
}
