package source

import (
	"bytes"
	"context"
	"io"
	"sync"
	"testing"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/streamer"
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
			b.Run(name, func(b *testing.B) {
				var buf bytes.Buffer
				out, _ := streamer.NewStreamOutputAs([]io.Writer{&buf}, pipeline.Format{Seal: seal})
				m := pipelinetest.CaptureBench(b, total)(streamer.NewCapture(context.Background(), out, pipeline.Options{Codec: pipelinetest.MustSpec(b, spec)}))
				ctx := context.Background()
				b.SetBytes(total)
				b.ResetTimer()
				for range b.N {
					src := NewStreamSource(ctx, []io.Reader{bytes.NewReader(buf.Bytes())}, []string{"bench"},
						StreamOptions{Options: pipeline.Options{MemoryLimit: 2 * total, Key: key}, ServeEarly: true})
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
