package streamer

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/store/dir"
)

func BenchmarkCapture(b *testing.B) {
	total := pipelinetest.BenchMiB("GPUCR_BENCH_MIB", 1024)
	pipelinetest.BenchTemplate()
	for _, spec := range pipelinetest.BenchCodecs() {
		b.Run(spec, func(b *testing.B) {
			opts := pipeline.Options{Codec: pipelinetest.MustSpec(b, spec)}
			b.SetBytes(total)
			b.ResetTimer()
			var m *manifest.Manifest
			for range b.N {
				out, err := NewStreamOutput([]io.Writer{io.Discard})
				if err != nil {
					b.Fatal(err)
				}
				m = pipelinetest.CaptureBench(b, total)(NewCapture(context.Background(), out, opts))
			}
			b.StopTimer()
			b.ReportMetric(m.Stats.Ratio(), "ratio")
		})
	}
}

// BenchmarkCaptureArchiveLanes captures (codec none) into an archive in
// a directory, GPUCR_BENCH_DIR (default a temp dir; /dev/shm keeps the
// disk out), with one lane (one segment written at a time) and with
// DefaultLanes: the ratio is what writing several segments at once buys,
// and grows with cores.
//
//	GPUCR_BENCH_DIR=/dev/shm GPUCR_BENCH_MIB=4096 go test -run X -bench CaptureArchiveLanes -benchtime 3x ./streamer/
func BenchmarkCaptureArchiveLanes(b *testing.B) {
	total := pipelinetest.BenchMiB("GPUCR_BENCH_MIB", 1024)
	pipelinetest.BenchTemplate()
	benchLanes(b, total, func(b *testing.B, out *ArchiveOutput) {
		pipelinetest.CaptureBench(b, total)(NewCapture(context.Background(), out, pipeline.Options{Codec: pipelinetest.MustSpec(b, "none")}))
	})
}

// benchLanes runs write total bytes into a fresh archive per iteration
// (benchArchive), with one lane and with DefaultLanes.
func benchLanes(b *testing.B, total int64, write func(b *testing.B, out *ArchiveOutput)) {
	for _, lanes := range []int{1, DefaultLanes()} {
		b.Run(fmt.Sprintf("lanes=%d", lanes), func(b *testing.B) {
			b.SetBytes(total)
			benchArchive(b, func(b *testing.B, out *ArchiveOutput) {
				out.SetLanes(lanes)
				write(b, out)
			})
		})
	}
}

// benchArchive runs write into a fresh archive in GPUCR_BENCH_DIR
// (default a temp dir) per iteration; only write is timed.
func benchArchive(b *testing.B, write func(b *testing.B, out *ArchiveOutput)) {
	base := os.Getenv("GPUCR_BENCH_DIR")
	if base == "" {
		base = b.TempDir()
	}
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		root, err := os.MkdirTemp(base, "gpucr-bench-")
		if err != nil {
			b.Fatal(err)
		}
		out, err := NewArchiveOutput(context.Background(), dir.New(root), 0)
		if err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		write(b, out)
		b.StopTimer()
		os.RemoveAll(root)
		b.StartTimer()
	}
}

// BenchmarkArchiveLanes isolates the archive's writing: 4 MiB DATA
// payloads (ready, as a capture's encoded chunks are) into an archive in
// GPUCR_BENCH_DIR, with one lane and with DefaultLanes.
//
//	GPUCR_BENCH_DIR=/dev/shm GPUCR_BENCH_MIB=4096 go test -run X -bench '^BenchmarkArchiveLanes' -benchtime 3x ./streamer/
func BenchmarkArchiveLanes(b *testing.B) {
	total := pipelinetest.BenchMiB("GPUCR_BENCH_MIB", 1024)
	const chunk = 4 << 20
	payloads := make([][]byte, 16)
	for i := range payloads {
		payloads[i] = pipelinetest.MixedData(chunk, uint64(i))
	}
	ctx := context.Background()
	benchLanes(b, total, func(b *testing.B, out *ArchiveOutput) {
		fh := manifest.FrameHeader{Type: manifest.FrameFile, FileID: 1}
		if _, err := out.WriteFrame(ctx, &fh, []byte("vram.bin")); err != nil {
			b.Fatal(err)
		}
		for off := int64(0); off < total; off += chunk {
			p := payloads[(off/chunk)%int64(len(payloads))]
			fh := manifest.FrameHeader{Type: manifest.FrameData, FileID: 1, Offset: uint64(off), RawLen: chunk}
			if _, err := out.WriteFrameAsync(ctx, &fh, p, func(error) {}); err != nil {
				b.Fatal(err)
			}
		}
		fh = manifest.FrameHeader{Type: manifest.FrameFileEnd, FileID: 1, Offset: uint64(total)}
		if _, err := out.WriteFrame(ctx, &fh, nil); err != nil {
			b.Fatal(err)
		}
		if err := out.Commit(ctx, &manifest.Manifest{ChunkSize: chunk, Codec: "none"}); err != nil {
			b.Fatal(err)
		}
	})
}

// BenchmarkCaptureBackground is a fast-path checkpoint's capture: 16 VRAM
// files (GPUCR_BENCH_MIB in all) stored from memory, and CRIU's pages (a
// sixteenth of that) starting once an eighth of the store is in, into an
// archive in GPUCR_BENCH_DIR (codec none). The store is written in the
// foreground (as before) and in the background (WriteBackground); dump-s
// is how long the pages took, what the checkpoint waits for with the
// process frozen, and ns/op the whole capture.
//
//	GPUCR_BENCH_DIR=/dev/shm GPUCR_BENCH_MIB=8192 go test -run X -bench CaptureBackground -benchtime 3x ./streamer/
func BenchmarkCaptureBackground(b *testing.B) {
	total := pipelinetest.BenchMiB("GPUCR_BENCH_MIB", 1024)
	tmpl := pipelinetest.BenchTemplate()
	per := total / benchStoreFiles
	for _, mode := range []string{"foreground", "background"} {
		b.Run("store="+mode, func(b *testing.B) {
			benchStoreBeside(b, total, func(c *Capture, i int) error {
				r := &pipelinetest.RepeatReader{Tmpl: tmpl, Off: int64(i) * per, N: per}
				name := fmt.Sprintf("vram-1-%d.bin", i)
				var err error
				if mode == "foreground" {
					_, err = c.WriteFile(name, r, true)
				} else {
					_, err = c.WriteBackground(name, r)
				}
				return err
			})
		})
	}
}

// benchStoreFiles is how many VRAM files the store benchmarks write.
const benchStoreFiles = 16

// benchStoreBeside runs a fast-path capture: store writes VRAM file i of
// benchStoreFiles (total bytes in all) into c, and CRIU's pages (a
// sixteenth of total) start once an eighth of the store is in. It reports
// dump-s, how long the pages took. GPUCR_BENCH_LANES sets the archive's
// lanes, GPUCR_BENCH_BACKGROUND_CHUNKS the background chunks in flight,
// GPUCR_BENCH_CODEC the codec (none).
func benchStoreBeside(b *testing.B, total int64, store func(c *Capture, i int) error) {
	tmpl := pipelinetest.BenchTemplate()
	per := total / benchStoreFiles
	lanes, _ := strconv.Atoi(os.Getenv("GPUCR_BENCH_LANES"))
	spec := cmp.Or(os.Getenv("GPUCR_BENCH_CODEC"), "none")
	if n, err := strconv.Atoi(os.Getenv("GPUCR_BENCH_BACKGROUND_CHUNKS")); err == nil {
		defer func(was int) { backgroundChunks = was }(backgroundChunks)
		backgroundChunks = n
	}
	b.SetBytes(total + per)
	var dump time.Duration
	benchArchive(b, func(b *testing.B, out *ArchiveOutput) {
		if lanes > 0 {
			out.SetLanes(lanes)
		}
		c, err := NewCapture(context.Background(), out, pipeline.Options{Codec: pipelinetest.MustSpec(b, spec)})
		if err != nil {
			b.Fatal(err)
		}
		var wg sync.WaitGroup
		for i := range benchStoreFiles {
			wg.Go(func() {
				if err := store(c, i); err != nil {
					b.Error(err)
				}
			})
		}
		for c.Counters.RawBytes.Load() < total/8 {
			time.Sleep(100 * time.Microsecond)
		}
		start := time.Now()
		if _, err := c.WriteFile("pages-1.img", &pipelinetest.RepeatReader{Tmpl: tmpl, N: per}, false); err != nil {
			b.Fatal(err)
		}
		dump += time.Since(start)
		wg.Wait()
		if _, err := c.Close(context.Background(), manifest.Manifest{Tool: "bench"}); err != nil {
			b.Fatal(err)
		}
	})
	b.ReportMetric(dump.Seconds()/float64(b.N), "dump-s")
}
