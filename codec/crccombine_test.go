package codec

import (
	"math/rand/v2"
	"testing"
)

// A combined CRC-32C must equal the CRC-32C over the bytes, whatever the
// lengths of the parts, empty ones included.
func TestCombineChecksum(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	data := make([]byte, 1<<20)
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	cases := []struct{ a, b int }{{0, 0}, {0, 1}, {1, 0}, {1, 1}, {3, 5}, {4096, 4096}, {0, 4096}, {4096, 0},
		{5, 1<<20 - 5}, {1<<20 - 1, 1}, {100000, 7}}
	for range 200 {
		a := r.IntN(len(data) + 1)
		cases = append(cases, struct{ a, b int }{a, r.IntN(len(data) - a + 1)})
	}
	for _, tc := range cases {
		a, b := data[:tc.a], data[tc.a:tc.a+tc.b]
		want := Checksum(data[:tc.a+tc.b])
		if got := CombineChecksum(Checksum(a), Checksum(b), int64(len(b))); got != want {
			t.Errorf("a %d bytes, b %d: combined %08x, direct %08x", tc.a, tc.b, got, want)
		}
	}
	// Zeros too: a zero part's CRC-32C is not zero.
	zeros := make([]byte, 10000)
	for _, n := range []int{0, 1, 4096, 10000} {
		if got, want := CombineChecksum(Checksum(data[:77]), Checksum(zeros[:n]), int64(n)),
			Checksum(append(append([]byte(nil), data[:77]...), zeros[:n]...)); got != want {
			t.Errorf("then %d zeros: combined %08x, direct %08x", n, got, want)
		}
	}
}

// A ChecksumCombiner for the part size joins a run of parts into the
// CRC-32C of the run, from any start, as a content-defined chunk of pages
// is summed.
func TestChecksumCombiner(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	data := make([]byte, 4<<20)
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	copy(data[64<<10:], make([]byte, 64<<10)) // a run of zero pages
	type run struct{ part, start, parts int }
	cases := []run{{4096, 0, 0}, {4096, 0, 1}, {4096, 0, 2}, {4096, 3, 1021}, {4096, 10, 40}, {1, 5, 1000}, {1000, 0, 4194}}
	for range 100 {
		part := []int{4096, 4096, 1, 512, 65536, 12345}[r.IntN(6)]
		max := len(data) / part
		start := r.IntN(max)
		cases = append(cases, run{part, start, r.IntN(max - start + 1)})
	}
	combiners := map[int]*ChecksumCombiner{}
	for _, tc := range cases {
		c := combiners[tc.part]
		if c == nil {
			c = NewChecksumCombiner(int64(tc.part))
			combiners[tc.part] = c
		}
		var crc uint32 // of nothing yet
		for i := range tc.parts {
			off := (tc.start + i) * tc.part
			crc = c.Combine(crc, Checksum(data[off:off+tc.part]))
		}
		off := tc.start * tc.part
		if want := Checksum(data[off : off+tc.parts*tc.part]); crc != want {
			t.Errorf("%d parts of %d bytes from part %d: combined %08x, direct %08x", tc.parts, tc.part, tc.start, crc, want)
		}
	}
}

func BenchmarkChecksumCombiner(b *testing.B) {
	c := NewChecksumCombiner(4096)
	crc := uint32(1)
	for b.Loop() {
		crc = c.Combine(crc, 0x12345678)
	}
	_ = crc
}
