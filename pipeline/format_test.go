package pipeline

import (
	"testing"

	"github.com/gpucr/gpucr-stream/codec"
)

// Zero chunks of many lengths (a hostile stream declares a new one in every
// frame) neither grow the cache without bound nor allocate a buffer per
// length, and every length still gets its right sums.
func TestZeroSumsBounded(t *testing.T) {
	for n := 1; n <= 3*maxZeroSums; n++ {
		crc, hash := zeroSums(n * 4096)
		z := make([]byte, n*4096)
		if crc != codec.Checksum(z) || hash != codec.ContentHash(z) {
			t.Fatalf("zeroSums(%d) wrong", n*4096)
		}
	}
	cached := 0
	zeroSumCache.Range(func(any, any) bool { cached++; return true })
	if cached > maxZeroSums {
		t.Fatalf("%d zero-chunk lengths cached, want at most %d", cached, maxZeroSums)
	}
	if allocs := testing.AllocsPerRun(10, func() { zeroSums(3*maxZeroSums*4096 + 512) }); allocs > 1 {
		t.Fatalf("zeroSums of an uncached length allocates %.0f times", allocs)
	}
	if crc, _ := zeroSums(codec.MaxChunk + 1); crc != 0 {
		t.Fatal("sums for a length over MaxChunk")
	}
}
