package source

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/streamer"
)

// BenchmarkRestoreDedupFiles reads back 16 files that were captured at
// once (as the GPU fast path's VRAM files are), all 16 at once, out of a
// plain archive and out of a deduplicated checkpoint of the same bytes
// (cpu-s/GiB: the process's, the readers of the pipes included).
func BenchmarkRestoreDedupFiles(b *testing.B) {
	ctx := context.Background()
	const files, size = 16, 32 << 20
	imgs := map[string][]byte{}
	for i := range files {
		imgs[fmt.Sprintf("vram-1-%02d.bin", i)] = pipelinetest.MixedData(size, uint64(i+1))
	}
	opts := pipeline.Options{Codec: pipelinetest.MustSpec(b, "none")}
	loc := dir.New(b.TempDir())
	capture := func(out streamer.Output) {
		c, err := streamer.NewCapture(ctx, out, opts)
		if err != nil {
			b.Fatal(err)
		}
		writeAtOnce(b, c, imgs)
		if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
			b.Fatal(err)
		}
	}
	out, err := streamer.NewArchiveOutput(ctx, store.Sub(loc, "plain"), 0)
	if err != nil {
		b.Fatal(err)
	}
	out.SetLanes(8) // as on a 16-core host, where the fast path writes 16 files
	capture(out)
	dout, err := streamer.NewDedupOutput(ctx, store.Sub(loc, "dedup"), loc, 8<<20, nil)
	if err != nil {
		b.Fatal(err)
	}
	dout.SetLanes(8)
	capture(dout)
	for _, name := range []string{"plain", "dedup"} {
		b.Run(name, func(b *testing.B) {
			stageCPU(b, int64(files*size), false, func() {
				a, err := OpenArchive(ctx, store.Sub(loc, name), pipeline.Options{})
				if err != nil {
					b.Fatal(err)
				}
				var wg sync.WaitGroup
				for n := range imgs {
					wg.Go(func() {
						r, w, err := os.Pipe()
						if err != nil {
							b.Error(err)
							return
						}
						done := make(chan struct{})
						go func() {
							defer close(done)
							buf := make([]byte, 4<<20)
							for {
								if _, err := r.Read(buf); err != nil {
									return
								}
							}
						}()
						if _, err := a.Copy(ctx, n, w); err != nil {
							b.Error(err)
						}
						w.Close()
						<-done
						r.Close()
					})
				}
				wg.Wait()
				a.Close()
			})
		})
	}
}
