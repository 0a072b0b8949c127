package streamer

import (
	"bytes"
	"context"
	"io"
	"sync"
	"testing"

	"github.com/gpucr/gpucr-stream/crypt"
)

// BenchmarkCaptureSealed and BenchmarkStreamSourceSealed run the pipeline
// plain and encrypted on the same data in one run, so the cost of
// encryption is their ratio (GPUCR_BENCH_MIB, GPUCR_BENCH_SOURCE_MIB and
// GPUCR_BENCH_CODECS as for the other benchmarks; default codec lz4).
func sealedBenchCodecs() []string {
	if c := benchCodecs(); len(c) != 6 {
		return c
	}
	return []string{"lz4"}
}

func benchKey(b *testing.B) *crypt.Session {
	k, err := crypt.NewKey(bytes.Repeat([]byte{5}, crypt.KeySize))
	if err != nil {
		b.Fatal(err)
	}
	return testSession(b, k)
}

func BenchmarkCaptureSealed(b *testing.B) {
	total := benchMiB("GPUCR_BENCH_MIB", 1024)
	benchTemplate()
	for _, spec := range sealedBenchCodecs() {
		for _, sealed := range []bool{false, true} {
			name := spec + "/plain"
			if sealed {
				name = spec + "/aes-256-gcm"
			}
			b.Run(name, func(b *testing.B) {
				b.SetBytes(total)
				for range b.N {
					var seal *crypt.Session
					if sealed {
						seal = benchKey(b)
					}
					out, err := NewStreamOutputAs([]io.Writer{io.Discard}, Format{Seal: seal})
					if err != nil {
						b.Fatal(err)
					}
					captureBench(b, out, Options{Codec: mustSpec(b, spec)}, total)
				}
			})
		}
	}
}

func BenchmarkStreamSourceSealed(b *testing.B) {
	total := benchMiB("GPUCR_BENCH_SOURCE_MIB", 256)
	for _, spec := range sealedBenchCodecs() {
		for _, sealed := range []bool{false, true} {
			name := spec + "/plain"
			var seal *crypt.Session
			var key *crypt.Key
			if sealed {
				name = spec + "/aes-256-gcm"
				key, _ = crypt.NewKey(bytes.Repeat([]byte{5}, crypt.KeySize))
				seal = benchKey(b)
			}
			b.Run(name, func(b *testing.B) {
				var buf bytes.Buffer
				out, _ := NewStreamOutputAs([]io.Writer{&buf}, Format{Seal: seal})
				m := captureBench(b, out, Options{Codec: mustSpec(b, spec)}, total)
				ctx := context.Background()
				b.SetBytes(total)
				b.ResetTimer()
				for range b.N {
					src := NewStreamSource(ctx, []io.Reader{bytes.NewReader(buf.Bytes())}, []string{"bench"},
						StreamOptions{Options: Options{MemoryLimit: 2 * total, Key: key}, ServeEarly: true})
					var wg sync.WaitGroup
					for _, f := range m.Files {
						wg.Add(1)
						go func() {
							defer wg.Done()
							if n, err := src.Copy(ctx, f.Name, io.Discard); err != nil || n != f.Size {
								b.Errorf("Copy(%s) = %d, %v", f.Name, n, err)
							}
						}()
					}
					wg.Wait()
					if err := src.Wait(ctx); err != nil {
						b.Fatal(err)
					}
					src.Close()
				}
			})
		}
	}
}
