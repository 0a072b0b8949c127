package criusock

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
)

// BenchmarkServeFileKind: one image served to a CRIU-like client in a
// process of its own (as in the tests: a request, a blocking read of the
// reply, its own pipe, then fstat and read to the end), as a pipe (any
// image) or as a sealed memfd handed to it in place of its pipe
// (nftables-N.img, asfile.go), by size. ns/file is the client's time per
// file, connection to last byte; what serving small files as memfds would
// cost or save. `make bench` runs it (scripts/bench.sh).
func BenchmarkServeFileKind(b *testing.B) {
	for _, size := range []int{256, 4 << 10, 64 << 10, 1 << 20} {
		for _, kind := range []struct{ name, file string }{{"pipe", "small.img"}, {"memfd", "nftables-1.img"}} {
			b.Run(fmt.Sprintf("%s/%s", kind.name, sizeName(size)), func(b *testing.B) {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
				defer cancel()
				src := streamOf(b, ctx, map[string][]byte{kind.file: amdPages(size, 1)[8:]})
				r, res, _, err := runClientWith(b, ctx, src, b.N, ServeOptions{}, kind.file)
				if err != nil || r.Error != "" {
					b.Fatalf("serve: %v; client: %s", err, r.Error)
				}
				for _, f := range r.Files {
					if f.Read != size || f.Regular != (kind.name == "memfd") {
						b.Fatalf("client read %d bytes (regular %v), want %d", f.Read, f.Regular, size)
					}
				}
				if res.Served != b.N {
					b.Fatalf("served %d of %d", res.Served, b.N)
				}
				b.ReportMetric(float64(r.Nanos)/float64(b.N), "ns/file")
			})
		}
	}
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

// streamOf is a stream source of files, held in memory.
func streamOf(t testing.TB, ctx context.Context, files map[string][]byte) source.Source {
	t.Helper()
	c, buf := newCapture(t, ctx)
	for name, b := range files {
		if _, err := c.WriteFile(name, bytes.NewReader(b), false); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		t.Fatal(err)
	}
	s := source.NewStreamSource(ctx, []io.Reader{bytes.NewReader(buf.Bytes())}, []string{"mem"}, source.StreamSourceOptions{})
	t.Cleanup(func() { s.Close() })
	return s
}
