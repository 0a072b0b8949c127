package codec

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"testing"
)

const benchChunk = 4 << 20

// benchCodecs are the encodings benchmarked: specs, plus the shuffle codecs
// with a fixed element size (forced through encodeAs).
var benchCodecs = []string{"none", "lz4", "zstd", "zstd:3", "zstd:9", "zstd:19", "shuffle", "shuffle2+zstd", "shuffle4+zstd", "auto"}

// benchEncode returns a function encoding a chunk as codec name says.
func benchEncoder(tb testing.TB, name string) func(dst, raw []byte) (ID, []byte) {
	forced := map[string]ID{"shuffle2+zstd": Shuffle2Zstd, "shuffle4+zstd": Shuffle4Zstd}
	if id, ok := forced[name]; ok {
		e, err := NewEncoder(Spec{kind: specShuffle})
		if err != nil {
			tb.Fatal(err)
		}
		// The element size is fixed; the rest is decided as for "shuffle".
		return func(dst, raw []byte) (ID, []byte) {
			p := planShuffle(raw)
			p.id = id
			return e.encodeAs(p, dst, raw)
		}
	}
	s, err := ParseSpec(name)
	if err != nil {
		tb.Fatal(err)
	}
	e, err := NewEncoder(s)
	if err != nil {
		tb.Fatal(err)
	}
	return func(dst, raw []byte) (ID, []byte) {
		id, out, err := e.Encode(dst, raw)
		if err != nil {
			tb.Fatal(err)
		}
		return id, out
	}
}

var benchData = map[string][]byte{}

func benchInput(d dataKind) []byte {
	if b, ok := benchData[d.name]; ok {
		return b
	}
	b := d.gen(benchChunk, 42)
	benchData[d.name] = b
	return b
}

func BenchmarkEncode(b *testing.B) {
	for _, c := range benchCodecs {
		b.Run(c, func(b *testing.B) {
			for _, d := range dataKinds {
				b.Run(d.name, func(b *testing.B) {
					enc := benchEncoder(b, c)
					raw := benchInput(d)
					dst := make([]byte, 0, MaxEncodedLen(ID(255), len(raw)))
					id, out := enc(dst, raw) // warm up pools and encoders
					b.SetBytes(int64(len(raw)))
					b.ResetTimer()
					for b.Loop() {
						id, out = enc(dst, raw)
					}
					b.ReportMetric(float64(len(raw))/float64(max(len(out), 1)), "ratio")
					b.ReportMetric(float64(id), "id")
				})
			}
		})
	}
}

func BenchmarkDecode(b *testing.B) {
	for _, c := range benchCodecs {
		b.Run(c, func(b *testing.B) {
			for _, d := range dataKinds {
				b.Run(d.name, func(b *testing.B) {
					raw := benchInput(d)
					id, out := benchEncoder(b, c)(nil, raw)
					stored := bytes.Clone(out)
					dst := make([]byte, len(raw))
					if err := Decode(id, dst, stored); err != nil {
						b.Fatal(err)
					}
					b.SetBytes(int64(len(raw)))
					b.ResetTimer()
					for b.Loop() {
						if err := Decode(id, dst, stored); err != nil {
							b.Fatal(err)
						}
					}
					b.ReportMetric(float64(len(raw))/float64(max(len(stored), 1)), "ratio")
				})
			}
		})
	}
}

func BenchmarkChecksum(b *testing.B) {
	raw := benchInput(dataKinds[0])
	b.SetBytes(int64(len(raw)))
	for b.Loop() {
		Checksum(raw)
	}
}

// BenchmarkContentHash: a whole chunk, and the sizes of content-defined
// ones (on page boundaries, anywhere in a 16 KiB SIMD group), on each set
// of kernels this CPU has.
func BenchmarkContentHash(b *testing.B) {
	raw := benchInput(dataKinds[0])
	for kernels := range hashKernels() {
		for _, n := range []int{len(raw), 320 << 10, 332 << 10} {
			b.Run(fmt.Sprintf("%s/%dKiB", strings.Fields(kernels)[0], n>>10), func(b *testing.B) {
				b.SetBytes(int64(n))
				for b.Loop() {
					ContentHash(raw[:n])
				}
			})
		}
	}
}

func BenchmarkIsZero(b *testing.B) {
	raw := make([]byte, benchChunk)
	b.SetBytes(int64(len(raw)))
	for b.Loop() {
		if !IsZero(raw) {
			b.Fatal("not zero")
		}
	}
}

func BenchmarkShuffle(b *testing.B) {
	raw := benchInput(dataKinds[0])
	dst := make([]byte, len(raw))
	for _, k := range []int{2, 4} {
		b.Run(fmt.Sprintf("shuffle%d", k), func(b *testing.B) {
			b.SetBytes(int64(len(raw)))
			for b.Loop() {
				shuffle(dst, raw, k)
			}
		})
		b.Run(fmt.Sprintf("unshuffle%d", k), func(b *testing.B) {
			b.SetBytes(int64(len(raw)))
			for b.Loop() {
				unshuffle(dst, raw, k)
			}
		})
		b.Run(fmt.Sprintf("generic%d", k), func(b *testing.B) {
			b.SetBytes(int64(len(raw)))
			for b.Loop() {
				shuffleGeneric(dst, raw, k)
			}
		})
	}
}

// BenchmarkChoose measures the auto chooser alone (sampling + statistics).
func BenchmarkChoose(b *testing.B) {
	for _, d := range dataKinds {
		b.Run(d.name, func(b *testing.B) {
			raw := benchInput(d)
			b.SetBytes(int64(len(raw)))
			var p plan
			for b.Loop() {
				p = planAuto(raw)
			}
			b.ReportMetric(float64(p.id), "id")
		})
	}
}

// BenchmarkImage encodes and decodes a real image file chunk by chunk on one
// goroutine (per-core throughput): GPUCR_BENCH_IMAGE=path/to/pages-1.img.
// scripts/bench.sh points it at the pages of a freshly dumped target.
func BenchmarkImage(b *testing.B) {
	path := os.Getenv("GPUCR_BENCH_IMAGE")
	if path == "" {
		b.Skip("GPUCR_BENCH_IMAGE not set")
	}
	img, err := os.ReadFile(path)
	if err != nil {
		b.Fatal(err)
	}
	const chunk = 4 << 20
	for _, spec := range []string{"none", "lz4", "zstd", "zstd:3", "shuffle", "auto"} {
		s, err := ParseSpec(spec)
		if err != nil {
			b.Fatal(err)
		}
		enc, err := NewEncoder(s)
		if err != nil {
			b.Fatal(err)
		}
		dst := make([]byte, enc.MaxEncodedLen(chunk))
		raw := make([]byte, chunk)
		b.Run("encode/"+spec, func(b *testing.B) {
			b.SetBytes(int64(len(img)))
			var stored int
			for range b.N {
				stored = 0
				for off := 0; off < len(img); off += chunk {
					_, out, err := enc.Encode(dst, img[off:min(off+chunk, len(img))])
					if err != nil {
						b.Fatal(err)
					}
					stored += len(out)
				}
			}
			b.ReportMetric(float64(len(img))/float64(max(stored, 1)), "ratio")
		})
		b.Run("decode/"+spec, func(b *testing.B) {
			type enc1 struct {
				id  ID
				out []byte
				n   int
			}
			var chunks []enc1
			for off := 0; off < len(img); off += chunk {
				in := img[off:min(off+chunk, len(img))]
				id, out, _ := enc.Encode(make([]byte, enc.MaxEncodedLen(len(in))), in)
				chunks = append(chunks, enc1{id, append([]byte(nil), out...), len(in)})
			}
			b.SetBytes(int64(len(img)))
			b.ResetTimer()
			for range b.N {
				for _, c := range chunks {
					if c.id == Zero {
						continue
					}
					if err := Decode(c.id, raw[:c.n], c.out); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}
