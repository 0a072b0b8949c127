package source

import (
	"bytes"
	"context"
	"io"
	"testing"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/streamer"
)

// BenchmarkRestoreDedup reads a 256 MiB image back from a directory, out of
// a plain archive and out of a deduplicated checkpoint of the same bytes,
// in one run: what a restore spends in gpucr-stream for each (cpu-s/GiB:
// the process's CPU time, steadier than the wall clock on a shared machine).
func BenchmarkRestoreDedup(b *testing.B) {
	ctx := context.Background()
	img := pagesImage(65536, 7)
	opts := pipeline.Options{Codec: pipelinetest.MustSpec(b, "lz4")}
	loc := dir.New(b.TempDir())
	dedupCapture(b, loc, "dedup", map[string][]byte{"pages-1.img": img}, opts)
	out, err := streamer.NewArchiveOutput(ctx, store.Sub(loc, "plain"), 0)
	if err != nil {
		b.Fatal(err)
	}
	c, err := streamer.NewCapture(ctx, out, opts)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := c.WriteFile("pages-1.img", bytes.NewReader(img), false); err != nil {
		b.Fatal(err)
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		b.Fatal(err)
	}
	for _, name := range []string{"plain", "dedup"} {
		b.Run(name, func(b *testing.B) {
			stageCPU(b, int64(len(img)), false, func() {
				a, err := OpenArchive(ctx, store.Sub(loc, name), pipeline.Options{})
				if err != nil {
					b.Fatal(err)
				}
				if _, err := a.Copy(ctx, "pages-1.img", io.Discard); err != nil {
					b.Fatal(err)
				}
				a.Close()
			})
		})
	}
}
