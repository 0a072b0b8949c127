package streamer

import (
	"bytes"
	"io"
	"math/rand/v2"
	"syscall"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/codec"
)

// benchImage is n MiB shaped like a process image: a third noise, a third
// zero pages, a third text-like pages.
func benchImage(n int) []byte {
	r := rand.New(rand.NewPCG(1, 2))
	b := make([]byte, n<<20)
	for p := 0; p < len(b)/cdcPage; p++ {
		page := b[p*cdcPage : (p+1)*cdcPage]
		switch p % 3 {
		case 0:
			for i := 0; i < len(page); i += 8 {
				v := r.Uint64()
				for k := range 8 {
					page[i+k] = byte(v >> (8 * k))
				}
			}
		case 2:
			for i := range page {
				page[i] = "the quick brown fox "[r.IntN(20)]
			}
		}
	}
	return b
}

// BenchmarkDedupScan is what deduplication adds to a capture's CPU per
// byte, beside what a plain capture spends on the same bytes before
// encoding, in one run (docs/bench-log/2026-11.md): plain reads fixed 4 MiB chunks
// with their zero test and CRC-32C (the producer's chunkSums); dedup cuts
// them by content (page CRCs), hashes each with BLAKE3 and looks it up in a
// table of a million chunks. cpu-s/GiB is the process's CPU time
// (getrusage), which a loaded machine does not stretch as it does the
// wall clock (ns/op); with -cpu 1 the runtime's own work is on the same core.
// blake3 is the ids alone, of chunks of the same lengths, in the cache as
// they are after the cut (BLAKE3's time does not depend on the bytes): the
// part of what dedup adds that only a faster BLAKE3 would cut.
func BenchmarkDedupScan(b *testing.B) {
	img := benchImage(256)
	const chunk = 4 << 20
	buf := make([]byte, chunk)
	b.Run("plain", func(b *testing.B) {
		b.SetBytes(int64(len(img)))
		start := cpuTime()
		for b.Loop() {
			r := bytes.NewReader(img)
			for {
				var s chunkSums
				n, err := s.fill(r, buf)
				if n == 0 || err != nil {
					break
				}
			}
		}
		b.ReportMetric(perGiB(start, b.N, len(img)), "cpu-s/GiB")
	})
	b.Run("cdc+blake3+lookup", func(b *testing.B) {
		tbl := bigTable(1 << 20)
		b.SetBytes(int64(len(img)))
		start := cpuTime()
		found := 0
		for b.Loop() {
			c := newCutter(bytes.NewReader(img), chunk, nil)
			for {
				var s chunkSums
				n, err := c.next(buf, &s)
				if n > 0 && !s.zero {
					if tbl.Has(codec.ContentHash(buf[:n])) {
						found++
					}
				}
				if err == io.EOF || n == 0 {
					break
				}
			}
		}
		b.ReportMetric(perGiB(start, b.N, len(img)), "cpu-s/GiB")
		if found != 0 {
			b.Fatalf("found %d chunks in a table of random ids", found)
		}
	})
	b.Run("blake3", func(b *testing.B) {
		var lens []int
		c := newCutter(bytes.NewReader(img), chunk, nil)
		for {
			var s chunkSums
			n, err := c.next(buf, &s)
			if n > 0 && !s.zero {
				lens = append(lens, n)
			}
			if err == io.EOF || n == 0 {
				break
			}
		}
		b.SetBytes(int64(len(img)))
		start := cpuTime()
		for b.Loop() {
			for _, n := range lens {
				codec.ContentHash(buf[:n])
			}
		}
		b.ReportMetric(perGiB(start, b.N, len(img)), "cpu-s/GiB")
	})
}

// cpuTime is the process's CPU time so far, user and system.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru) // fails only for a bad argument
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// perGiB is the CPU time since start per GiB, for n rounds of size bytes.
func perGiB(start time.Duration, n, size int) float64 {
	return (cpuTime() - start).Seconds() / float64(n) / (float64(size) / (1 << 30))
}

// bigTable is a table of n random chunk ids.
func bigTable(n int) *chunkstore.Table {
	r := rand.New(rand.NewPCG(3, 4))
	pack := chunkstore.NewPackID()
	chunks := make([]chunkstore.Chunk, n)
	for i := range chunks {
		for k := 0; k < 32; k += 8 {
			v := r.Uint64()
			for j := range 8 {
				chunks[i].ID[k+j] = byte(v >> (8 * j))
			}
		}
		chunks[i].Ref = chunkstore.Ref{Pack: pack, RawLen: 1}
	}
	return chunkstore.TableOf([]chunkstore.Pack{{ID: pack, Size: 1 << 40}}, chunks)
}
