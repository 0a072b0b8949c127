package streamer

import (
	"context"
	"io"
	"testing"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
)

func BenchmarkCaptureSealed(b *testing.B) {
	total := pipelinetest.BenchMiB("GPUCR_BENCH_MIB", 1024)
	pipelinetest.BenchTemplate()
	for _, spec := range pipelinetest.SealedBenchCodecs() {
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
						seal = pipelinetest.BenchSession(b)
					}
					out, err := NewStreamOutputAs([]io.Writer{io.Discard}, pipeline.Format{Seal: seal})
					if err != nil {
						b.Fatal(err)
					}
					pipelinetest.CaptureBench(b, total)(NewCapture(context.Background(), out, pipeline.Options{Codec: pipelinetest.MustSpec(b, spec)}))
				}
			})
		}
	}
}
