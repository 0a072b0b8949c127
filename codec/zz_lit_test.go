package codec

import (
	"bytes"
	"os"
	"testing"
)

func TestLitProto(t *testing.T) {
	for _, d := range dataKinds {
		for _, k := range []int{1, 2, 4} {
			raw := d.gen(4<<20, 1)
			sh := make([]byte, len(raw))
			if k == 1 {
				copy(sh, raw)
			} else {
				shuffle(sh, raw, k)
			}
			out := litFrame(nil, sh)
			dst := make([]byte, len(raw))
			if err := zstdDecode(dst, out); err != nil || !bytes.Equal(dst, sh) {
				t.Fatalf("%s k=%d: %v", d.name, k, err)
			}
			t.Logf("%s k=%d ratio %.3f", d.name, k, float64(len(raw))/float64(len(out)))
			if d.name == "bf16" && k == 2 {
				os.WriteFile("/tmp/calib/bf16lit.zst", out, 0o644)
				os.WriteFile("/tmp/calib/bf16sh.raw", sh, 0o644)
			}
		}
	}
}

func BenchmarkLitProto(b *testing.B) {
	for _, d := range dataKinds[:2] {
		raw := d.gen(4<<20, 1)
		for _, k := range []int{2, 4} {
			b.Run(d.name+string(rune('0'+k)), func(b *testing.B) {
				sh := make([]byte, len(raw))
				dst := make([]byte, 0, len(raw)*2)
				var out []byte
				b.SetBytes(int64(len(raw)))
				for b.Loop() {
					shuffle(sh, raw, k)
					out = litFrame(dst, sh)
				}
				b.ReportMetric(float64(len(raw))/float64(len(out)), "ratio")
			})
		}
	}
}
