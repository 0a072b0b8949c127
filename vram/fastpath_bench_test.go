package vram

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
	dirstore "github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/streamer"
)

// BenchmarkFastPathSink measures the Go side of the fast path's copy out
// without a GPU: 8 pipes fed as fast as writes go (the library's copy
// threads), read by FastSuspend's consumers: into io.Discard, with the kept
// copy (tee) or not, into a capture (codec none, archive in
// GPUCR_BENCH_DIR, default a temp dir; /dev/shm isolates the pipeline from
// the disk). GPUCR_BENCH_MIB sets the bytes per iteration (default 1024).
//
//	GPUCR_BENCH_DIR=/dev/shm GPUCR_BENCH_MIB=13000 go test -run X -bench FastPathSink -benchtime 1x ./vram/
func BenchmarkFastPathSink(b *testing.B) {
	mib := 1024
	if v := os.Getenv("GPUCR_BENCH_MIB"); v != "" {
		fmt.Sscan(v, &mib)
	}
	base := os.Getenv("GPUCR_BENCH_DIR")
	if base == "" {
		base = b.TempDir()
	}
	buf := make([]byte, 32<<20)
	rand.Read(buf)
	for _, tc := range []struct {
		name          string
		capture, keep bool
	}{
		{"discard", false, false}, {"discard+keep", false, true}, {"capture", true, false}, {"capture+keep", true, true},
	} {
		b.Run(tc.name, func(b *testing.B) {
			b.SetBytes(int64(mib) << 20)
			for i := 0; i < b.N; i++ {
				dir, err := os.MkdirTemp(base, "gpucr-bench-")
				if err != nil {
					b.Fatal(err)
				}
				sinkPipes(b, buf, int64(mib)<<20, 8, dir, tc.capture, tc.keep)
				b.StopTimer()
				os.RemoveAll(dir)
				b.StartTimer()
			}
		})
	}
}

func sinkPipes(b *testing.B, buf []byte, total int64, n int, dir string, capture, keep bool) {
	ctx := context.Background()
	var c *streamer.Capture
	if capture {
		spec, _ := codec.ParseSpec("none")
		out, err := streamer.NewArchiveOutput(ctx, dirstore.New(filepath.Join(dir, "ar")), 256<<20)
		if err != nil {
			b.Fatal(err)
		}
		if c, err = streamer.NewCapture(ctx, out, streamer.Options{Codec: spec, ChunkSize: 4 << 20, MemoryLimit: 1 << 30}); err != nil {
			b.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for k := 0; k < n; k++ {
		r, w, err := pipePair()
		if err != nil {
			b.Fatal(err)
		}
		wg.Add(2)
		go func() { // the library's copy thread
			defer wg.Done()
			defer w.Close()
			for left := total / int64(n); left > 0; {
				m := min(left, int64(len(buf)))
				if _, err := w.Write(buf[:m]); err != nil {
					return
				}
				left -= m
			}
		}()
		go func(k int) { // FastSuspend's consumer
			defer wg.Done()
			defer r.Close()
			var src io.Reader = r
			if keep {
				f, err := os.Create(filepath.Join(dir, fmt.Sprintf("keep-%d", k)))
				if err != nil {
					errs[k] = err
					return
				}
				defer f.Close()
				src = io.TeeReader(r, f)
			}
			if c != nil {
				_, errs[k] = c.WriteFile(fmt.Sprintf("vram-%02d.bin", k), src, true)
			} else {
				_, errs[k] = io.Copy(io.Discard, src)
			}
		}(k)
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			b.Fatal(err)
		}
	}
	if c != nil {
		if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
			b.Fatal(err)
		}
	}
}
