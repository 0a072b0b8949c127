package source

import (
	"bytes"
	"testing"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
)

func BenchmarkStreamSourceSealed(b *testing.B) {
	total := pipelinetest.BenchMiB("GPUCR_BENCH_SOURCE_MIB", 256)
	for _, spec := range pipelinetest.SealedBenchCodecs() {
		for _, sealed := range []bool{false, true} {
			name := spec + "/plain"
			var seal *crypt.Session
			var key *crypt.Key
			if sealed {
				name = spec + "/aes-256-gcm"
				key, _ = crypt.NewKey(bytes.Repeat([]byte{5}, crypt.KeySize))
				seal = pipelinetest.BenchSession(b)
			}
			b.Run(name, func(b *testing.B) { benchStreamSource(b, spec, total, seal, key) })
		}
	}
}
