package codec

import (
	"encoding/binary"
	"math"
	"testing"
	"time"
)

// GPU checkpoint data the other tests do not cover: fp16 weights, and
// chunks that mix kinds as a CUDA process's host copy of device memory does
// (weights, then an fp32 optimizer state, then zeroed KV cache).

// fp16Data: weights from N(0, 0.02) as IEEE half precision, little endian.
func fp16Data(n int, seed uint64) []byte {
	r := newRand(seed)
	b := make([]byte, n)
	for i := 0; i+2 <= n; i += 2 {
		binary.LittleEndian.PutUint16(b[i:], toHalf(float32(r.NormFloat64()*0.02)))
	}
	if n%2 == 1 {
		b[n-1] = byte(r.Uint32())
	}
	return b
}

// toHalf rounds a float32 to the nearest IEEE 754 binary16 (subnormals
// flushed to zero: weights of this scale have none).
func toHalf(f float32) uint16 {
	bits := math.Float32bits(f)
	sign := uint16(bits>>16) & 0x8000
	exp := int((bits>>23)&0xff) - 127 + 15
	mant := bits & 0x7fffff
	switch {
	case exp <= 0:
		return sign
	case exp >= 31:
		return sign | 0x7c00
	}
	h := sign | uint16(exp)<<10 | uint16(mant>>13)
	if mant&0x1000 != 0 { // round half up
		h++
	}
	return h
}

func mixedData(n int, seed uint64) []byte {
	b := make([]byte, 0, n)
	b = append(b, bf16Data(n/3, seed)...)
	b = append(b, fp32Data(n/3&^3, seed+1)...)
	return append(b, make([]byte, n-len(b))...)
}

// TestFloatRoundTrip: bf16, fp16 and fp32 weights and a mixed chunk,
// through every codec spec and every forced codec, at sizes with odd
// tails; auto must pick the byte-plane codec of the right element size
// for pure float chunks and never store more than raw.
func TestFloatRoundTrip(t *testing.T) {
	kinds := []dataKind{{"bf16", bf16Data}, {"fp16", fp16Data}, {"fp32", fp32Data}, {"mixed", mixedData}}
	for _, spec := range []string{"none", "lz4", "zstd", "shuffle", "auto"} {
		e := mustEncoder(t, spec)
		for _, d := range kinds {
			for _, n := range []int{1, 3, 4097, 1<<20 + 3} {
				raw := d.gen(n, uint64(n)+11)
				id, stored, err := e.Encode(nil, raw)
				if err != nil {
					t.Fatalf("%s on %s/%d: %v", spec, d.name, n, err)
				}
				if len(stored) > len(raw) {
					t.Fatalf("%s on %s/%d: stored %d > raw %d", spec, d.name, n, len(stored), len(raw))
				}
				checkEncoded(t, raw, id, stored)
			}
		}
	}
	auto := mustEncoder(t, "auto")
	for _, p := range allPlans {
		for _, d := range kinds {
			raw := d.gen(256<<10+1, 3)
			got, stored := auto.encodeAs(p, nil, raw)
			checkEncoded(t, raw, got, stored)
		}
	}
	for name, want := range map[string]ID{"bf16": Shuffle2Zstd, "fp16": Shuffle2Zstd, "fp32": Shuffle4Zstd} {
		for _, d := range kinds {
			if d.name != name {
				continue
			}
			if id, _, _ := auto.Encode(nil, d.gen(4<<20, 5)); id != want {
				t.Errorf("auto on %s picked %v, want %v", name, id, want)
			}
		}
	}
}

// TestFloatRatios reports what auto and lz4 make of model-like data, and
// how fast (one core); it holds the bf16 aim of the design (1.35x).
func TestFloatRatios(t *testing.T) {
	kinds := []dataKind{{"bf16", bf16Data}, {"fp16", fp16Data}, {"fp32", fp32Data}, {"mixed", mixedData}}
	for _, d := range kinds {
		raw := d.gen(4<<20, 21)
		for _, spec := range []string{"lz4", "auto"} {
			e := mustEncoder(t, spec)
			start := time.Now()
			var stored []byte
			var id ID
			const reps = 1
			for range reps {
				id, stored, _ = e.Encode(nil, raw)
			}
			secs := time.Since(start).Seconds() / reps
			ratio := float64(len(raw)) / float64(len(stored))
			t.Logf("%-5s %-4s -> %-14v ratio %.3f  %5.0f MB/s", d.name, spec, id, ratio, float64(len(raw))/secs/1e6)
			if spec == "auto" && d.name == "bf16" && ratio < 1.35 {
				t.Errorf("auto on bf16: ratio %.3f < 1.35", ratio)
			}
		}
	}
}
