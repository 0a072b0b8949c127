package codec

import (
	"os"
	"testing"
)

func BenchmarkCalib(b *testing.B) {
	raw, err := os.ReadFile("/tmp/calib/gosrc.txt")
	if err != nil {
		b.Skip()
	}
	for _, c := range []string{"lz4", "zstd", "shuffle2+zstd", "auto"} {
		b.Run(c, func(b *testing.B) {
			enc := benchEncoder(b, c)
			dst := make([]byte, 0, len(raw)*2)
			var out []byte
			b.SetBytes(int64(len(raw)))
			for b.Loop() {
				_, out = enc(dst, raw)
			}
			b.ReportMetric(float64(len(raw))/float64(len(out)), "ratio")
		})
	}
}
