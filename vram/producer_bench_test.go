package vram

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/fsat"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	dirstore "github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/streamer"
)

// BenchmarkFastPathSink measures the Go side of the fast path's copy out
// without a GPU, the old flow against the new in one run. A fake writer
// stands for the library's 8 copy threads, writing 32 MiB buffers as fast
// as write(2) goes.
//
//   - pipe/...: the old flow: the threads write pipes, read by consumers
//     that tee into the kept copy (keep-*) and store into io.Discard or a
//     capture; the device is busy until the last byte is stored.
//   - file/...: the new flow: the threads write the kept files themselves
//     (the device is free once they are done: release-GB/s), then the
//     files are stored, one reader each, into io.Discard or a capture.
//
// file/capture/lanes=1 writes one segment of the archive at a time,
// file/capture several at once (streamer.DefaultLanes).
//
// SetBytes makes MB/s the whole flow's (written and stored); release-GB/s
// is the rate at which the device would be freed. The capture has codec
// none, its archive in GPUCR_BENCH_DIR (default a temp dir; /dev/shm
// isolates the pipeline from the disk; the kept copy goes there too).
// GPUCR_BENCH_MIB sets the bytes per iteration (default 1024),
// GPUCR_BENCH_FILES the writers (default 8).
//
//	GPUCR_BENCH_DIR=/dev/shm GPUCR_BENCH_MIB=4096 go test -run X -bench FastPathSink -benchtime 3x ./vram/
func BenchmarkFastPathSink(b *testing.B) {
	mib, files := 1024, 8
	if v := os.Getenv("GPUCR_BENCH_MIB"); v != "" {
		fmt.Sscan(v, &mib)
	}
	if v := os.Getenv("GPUCR_BENCH_FILES"); v != "" {
		fmt.Sscan(v, &files)
	}
	base := os.Getenv("GPUCR_BENCH_DIR")
	if base == "" {
		base = b.TempDir()
	}
	buf := make([]byte, 32<<20)
	rand.Read(buf)
	total := int64(mib) << 20
	for _, tc := range []struct {
		name           string
		files, capture bool
		lanes          int // segments the archive writes at once; 0: its default
	}{
		{"pipe+keep/discard", false, false, 0}, {"pipe+keep/capture", false, true, 0},
		{"file/discard", true, false, 0}, {"file/capture/lanes=1", true, true, 1}, {"file/capture", true, true, 0},
	} {
		b.Run(tc.name, func(b *testing.B) {
			b.SetBytes(total)
			var busy time.Duration
			for i := 0; i < b.N; i++ {
				dir, err := os.MkdirTemp(base, "gpucr-bench-")
				if err != nil {
					b.Fatal(err)
				}
				c := benchCapture(b, dir, tc.capture, tc.lanes)
				t := time.Now()
				if tc.files {
					busy += sinkFiles(b, buf, total, files, dir, c)
				} else {
					sinkPipes(b, buf, total, files, dir, c)
					busy += time.Since(t)
				}
				if c != nil {
					if _, err := c.Close(context.Background(), manifest.Manifest{}); err != nil {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				os.RemoveAll(dir)
				b.StartTimer()
			}
			b.ReportMetric(float64(total)*float64(b.N)/busy.Seconds()/1e9, "release-GB/s")
		})
	}
}

// benchCapture is a capture into an archive in dir (codec none) with
// lanes lanes, or nil.
func benchCapture(b *testing.B, dir string, capture bool, lanes int) *streamer.Capture {
	if !capture {
		return nil
	}
	ctx := context.Background()
	spec, _ := codec.ParseSpec("none")
	out, err := streamer.NewArchiveOutput(ctx, dirstore.New(filepath.Join(dir, "ar")), 256<<20)
	if err != nil {
		b.Fatal(err)
	}
	out.SetLanes(lanes)
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{Codec: spec, ChunkSize: 4 << 20, MemoryLimit: 1 << 30})
	if err != nil {
		b.Fatal(err)
	}
	return c
}

// benchPut stores r into c, or reads it to its end without c.
func benchPut(c *streamer.Capture) PutFunc {
	return func(ctx context.Context, name string, r io.Reader) error {
		if c == nil {
			_, err := io.Copy(io.Discard, r)
			return err
		}
		_, err := c.WriteFile(name, r, true)
		return err
	}
}

// writeAll is one of the library's copy threads: total bytes into w.
func writeAll(w io.Writer, buf []byte, total int64) error {
	for left := total; left > 0; {
		m := min(left, int64(len(buf)))
		if _, err := w.Write(buf[:m]); err != nil {
			return err
		}
		left -= m
	}
	return nil
}

// sinkFiles is the new flow: n writers fill the kept files, then
// FastSuspension's store reads them into c. It returns the writers' time
// (the device is free after it).
func sinkFiles(b *testing.B, buf []byte, total int64, n int, dir string, c *streamer.Capture) time.Duration {
	t := time.Now()
	kd, err := fsat.OpenOwned(dir)
	if err != nil {
		b.Fatal(err)
	}
	defer kd.Close()
	s := &FastSuspension{keepDir: kd}
	fp := &fastProc{}
	var ws []*os.File
	for k := 0; k < n; k++ {
		name := fmt.Sprintf("vram-%02d.bin", k)
		os.Remove(filepath.Join(dir, name))
		w, err := fsat.Create(kd, name, os.O_WRONLY, 0o600)
		if err != nil {
			b.Fatal(err)
		}
		ws = append(ws, w)
		id, err := fsat.IDOf(w)
		if err != nil {
			b.Fatal(err)
		}
		fp.Files, fp.ids = append(fp.Files, name), append(fp.ids, id)
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for k, w := range ws {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[k] = writeAll(w, buf, total/int64(n))
			if err := w.Close(); errs[k] == nil {
				errs[k] = err
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		b.Fatal(err)
	}
	busy := time.Since(t)
	s.procs = []*fastProc{fp}
	s.startStore(context.Background(), benchPut(c))
	if err := s.Wait(context.Background()); err != nil {
		b.Fatal(err)
	}
	return busy
}

// sinkPipes is the old flow: n writers into pipes, consumers tee them into
// the kept copy and store them into c.
func sinkPipes(b *testing.B, buf []byte, total int64, n int, dir string, c *streamer.Capture) {
	put := benchPut(c)
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
			_ = writeAll(w, buf, total/int64(n))
		}()
		go func() { // the old copyOut's consumer
			defer wg.Done()
			defer r.Close()
			f, err := os.Create(filepath.Join(dir, fmt.Sprintf("keep-%d", k)))
			if err != nil {
				errs[k] = err
				return
			}
			defer f.Close()
			errs[k] = put(context.Background(), fmt.Sprintf("vram-%02d.bin", k), io.TeeReader(r, f))
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		b.Fatal(err)
	}
}
