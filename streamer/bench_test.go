package streamer

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/mem"
)

// Benchmark sizes, in MiB, from the environment so that a quick run
// (-benchtime 1x, small sizes) and a real measurement use the same code:
//
//	GPUCR_BENCH_MIB         bytes per Capture iteration (default 1024)
//	GPUCR_BENCH_SOURCE_MIB  checkpoint size for the source benchmarks (default 256)
//	GPUCR_BENCH_CODECS      space-separated codecs, e.g. "lz4 zstd" (default all)
func benchMiB(env string, def int) int64 {
	if v, err := strconv.Atoi(os.Getenv(env)); err == nil && v > 0 {
		return int64(v) << 20
	}
	return int64(def) << 20
}

func benchCodecs() []string {
	if v := os.Getenv("GPUCR_BENCH_CODECS"); v != "" {
		return strings.Fields(v)
	}
	return []string{"none", "lz4", "zstd", "zstd:3", "auto", "shuffle"}
}

// benchTemplate is 64 MiB of model-like content (bf16 and fp32 tensors,
// zero regions, pages, text, noise) that the benchmark readers repeat.
var benchTemplate = sync.OnceValue(func() []byte { return mixedData(64<<20, 99) })

// repeatReader reads n bytes of the template, starting at off.
type repeatReader struct {
	tmpl []byte
	off  int64
	n    int64
}

func (r *repeatReader) Read(p []byte) (int, error) {
	if r.n <= 0 {
		return 0, io.EOF
	}
	i := r.off % int64(len(r.tmpl))
	k := copy(p[:min(int64(len(p)), r.n)], r.tmpl[i:])
	r.off += int64(k)
	r.n -= int64(k)
	return k, nil
}

// benchFiles splits total into a checkpoint's shape: one large pages
// image (the process memory, VRAM included), a second large one, and many
// small images; returns name -> (offset into the template, size).
func benchFiles(total int64) map[string][2]int64 {
	files := map[string][2]int64{}
	const small = 48
	smallSize := int64(16 << 10)
	rest := total - small*smallSize
	if rest < 2 {
		rest, smallSize = total, 0
	}
	files["pages-1.img"] = [2]int64{0, rest * 7 / 8}
	files["pages-2.img"] = [2]int64{rest * 7 / 8, rest - rest*7/8}
	for i := range small {
		if smallSize > 0 {
			files[fmt.Sprintf("core-%d.img", i)] = [2]int64{int64(i) * 7919 * 4096, smallSize}
		}
	}
	return files
}

// captureBench writes the benchmark checkpoint through a new capture.
func captureBench(tb testing.TB, out Output, opts Options, total int64) *manifest.Manifest {
	ctx := context.Background()
	c, err := NewCapture(ctx, out, opts)
	if err != nil {
		tb.Fatal(err)
	}
	tmpl := benchTemplate()
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for name, f := range benchFiles(total) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := c.WriteFile(name, &repeatReader{tmpl: tmpl, off: f[0], n: f[1]}, false); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		tb.Fatal(err)
	}
	m, err := c.Close(ctx, manifest.Manifest{Tool: "bench"})
	if err != nil {
		tb.Fatal(err)
	}
	return m
}

func BenchmarkCapture(b *testing.B) {
	total := benchMiB("GPUCR_BENCH_MIB", 1024)
	benchTemplate()
	for _, spec := range benchCodecs() {
		b.Run(spec, func(b *testing.B) {
			opts := Options{Codec: mustSpec(b, spec)}
			b.SetBytes(total)
			b.ResetTimer()
			var m *manifest.Manifest
			for range b.N {
				out, err := NewStreamOutput([]io.Writer{io.Discard})
				if err != nil {
					b.Fatal(err)
				}
				m = captureBench(b, out, opts, total)
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
	total := benchMiB("GPUCR_BENCH_MIB", 1024)
	benchTemplate()
	benchLanes(b, total, func(b *testing.B, out *ArchiveOutput) {
		captureBench(b, out, Options{Codec: mustSpec(b, "none")}, total)
	})
}

// benchLanes runs write total bytes into a fresh archive in
// GPUCR_BENCH_DIR (default a temp dir) per iteration, with one lane and
// with DefaultLanes; only write is timed.
func benchLanes(b *testing.B, total int64, write func(b *testing.B, out *ArchiveOutput)) {
	base := os.Getenv("GPUCR_BENCH_DIR")
	if base == "" {
		base = b.TempDir()
	}
	for _, lanes := range []int{1, DefaultLanes()} {
		b.Run(fmt.Sprintf("lanes=%d", lanes), func(b *testing.B) {
			b.SetBytes(total)
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
				out.SetLanes(lanes)
				b.StartTimer()
				write(b, out)
				b.StopTimer()
				os.RemoveAll(root)
				b.StartTimer()
			}
		})
	}
}

// BenchmarkArchiveLanes isolates the archive's writing: 4 MiB DATA
// payloads (ready, as a capture's encoded chunks are) into an archive in
// GPUCR_BENCH_DIR, with one lane and with DefaultLanes.
//
//	GPUCR_BENCH_DIR=/dev/shm GPUCR_BENCH_MIB=4096 go test -run X -bench '^BenchmarkArchiveLanes' -benchtime 3x ./streamer/
func BenchmarkArchiveLanes(b *testing.B) {
	total := benchMiB("GPUCR_BENCH_MIB", 1024)
	const chunk = 4 << 20
	payloads := make([][]byte, 16)
	for i := range payloads {
		payloads[i] = mixedData(chunk, uint64(i))
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

func BenchmarkStreamSource(b *testing.B) {
	total := benchMiB("GPUCR_BENCH_SOURCE_MIB", 256)
	for _, spec := range benchCodecs() {
		b.Run(spec, func(b *testing.B) {
			var buf bytes.Buffer
			out, _ := NewStreamOutput([]io.Writer{&buf})
			m := captureBench(b, out, Options{Codec: mustSpec(b, spec)}, total)
			ctx := context.Background()
			b.SetBytes(total)
			b.ResetTimer()
			for range b.N {
				// Served early and copied as files complete, the way a
				// restore reads a stream; held in memory (no spill).
				src := NewStreamSource(ctx, []io.Reader{bytes.NewReader(buf.Bytes())}, []string{"bench"},
					StreamOptions{Options: Options{MemoryLimit: 2 * total}, ServeEarly: true})
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
			b.StopTimer()
			b.ReportMetric(float64(buf.Len())/float64(total), "stored/raw")
		})
	}
}

// benchArchive captures total bytes of benchmark data into an archive.
func benchArchive(b *testing.B, spec string, total int64) (*mem.Store, *manifest.Manifest) {
	store := mem.New("bench")
	out, err := NewArchiveOutput(context.Background(), store, 64<<20)
	if err != nil {
		b.Fatal(err)
	}
	return store, captureBench(b, out, Options{Codec: mustSpec(b, spec)}, total)
}

func BenchmarkArchiveSource(b *testing.B) {
	total := benchMiB("GPUCR_BENCH_SOURCE_MIB", 256)
	for _, spec := range benchCodecs() {
		b.Run(spec, func(b *testing.B) {
			ctx := context.Background()
			store, m := benchArchive(b, spec, total)
			b.SetBytes(total)
			b.ResetTimer()
			for range b.N {
				a, err := OpenArchive(ctx, store, Options{})
				if err != nil {
					b.Fatal(err)
				}
				// The large images one after the other, as CRIU restores
				// them; each Copy fetches and decodes its chunks in parallel.
				for _, f := range m.Files {
					if n, err := a.Copy(ctx, f.Name, io.Discard); err != nil || n != f.Size {
						b.Fatalf("Copy(%s) = %d, %v", f.Name, n, err)
					}
				}
				a.Close()
			}
			b.StopTimer()
			b.ReportMetric(m.Stats.Ratio(), "ratio")
		})
	}
}

// BenchmarkArchiveSourcePipe serves the archive into a pipe read by
// another goroutine, as CRIU reads it: by write(2), and by vmsplice(2).
func BenchmarkArchiveSourcePipe(b *testing.B) {
	total := benchMiB("GPUCR_BENCH_SOURCE_MIB", 256)
	for _, spec := range benchCodecs() {
		store, m := benchArchive(b, spec, total)
		benchIntoPipe(b, spec, total, m.Files, func() (Source, error) {
			return OpenArchive(context.Background(), store, Options{})
		})
	}
}

// BenchmarkStreamSourcePipe decodes a stream (as receive does) and serves
// it into a pipe read by another goroutine: by write(2), and by vmsplice(2).
func BenchmarkStreamSourcePipe(b *testing.B) {
	total := benchMiB("GPUCR_BENCH_SOURCE_MIB", 256)
	for _, spec := range benchCodecs() {
		var buf bytes.Buffer
		out, _ := NewStreamOutput([]io.Writer{&buf})
		m := captureBench(b, out, Options{Codec: mustSpec(b, spec)}, total)
		benchIntoPipe(b, spec, total, m.Files, func() (Source, error) {
			return NewStreamSource(context.Background(), []io.Reader{bytes.NewReader(buf.Bytes())}, []string{"bench"},
				StreamOptions{Options: Options{MemoryLimit: 2 * total}}), nil
		})
	}
}

// benchIntoPipe copies every file of a fresh source into pipes, once with
// write(2) and once with vmsplice(2).
func benchIntoPipe(b *testing.B, spec string, total int64, files []manifest.File, open func() (Source, error)) {
	ctx := context.Background()
	for _, mode := range []string{"write", "vmsplice"} {
		b.Run(spec+"/"+mode, func(b *testing.B) {
			defer func(v bool) { noSplice = v }(noSplice)
			noSplice = mode == "write"
			b.SetBytes(total)
			for range b.N {
				src, err := open()
				if err != nil {
					b.Fatal(err)
				}
				for _, f := range files {
					if err := copyToPipeReader(ctx, src, f); err != nil {
						b.Fatalf("Copy(%s): %v", f.Name, err)
					}
				}
				src.Close()
			}
		})
	}
}

// readerCPU counts the CPU time of the pipe readers (CRIU's part).
var readerCPU atomic.Int64

func copyToPipeReader(ctx context.Context, a Source, f manifest.File) error {
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	GrowPipe(w.Fd())
	read := make(chan int64, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		var ru0, ru1 syscall.Rusage
		syscall.Getrusage(unix.RUSAGE_THREAD, &ru0)
		n, _ := io.CopyBuffer(struct{ io.Writer }{io.Discard}, struct{ io.Reader }{r}, make([]byte, 1<<20))
		syscall.Getrusage(unix.RUSAGE_THREAD, &ru1)
		readerCPU.Add(ru1.Utime.Nano() + ru1.Stime.Nano() - ru0.Utime.Nano() - ru0.Stime.Nano())
		r.Close()
		read <- n
	}()
	n, err := a.Copy(ctx, f.Name, w)
	w.Close()
	if got := <-read; err == nil && (n != f.Size || got != f.Size) {
		err = fmt.Errorf("%d bytes copied, %d read, want %d", n, got, f.Size)
	}
	return err
}

// BenchmarkArchiveDirPipe serves a local archive (store/dir, in
// GPUCR_BENCH_DIR, default /dev/shm) of the thirds image (a third random,
// zeros, text: bench.sh's target) into a pipe read by another goroutine, as
// CRIU reads it, by vmsplice, with each read-ahead window of
// GPUCR_BENCH_READAHEAD (e.g. "2 4 0": 0 is the default rule). cpu-s/GiB
// counts the whole process, reader-cpu-s/GiB the reader alone (CRIU's
// part: its copy out of the pipe).
func BenchmarkArchiveDirPipe(b *testing.B) {
	total := benchMiB("GPUCR_BENCH_SOURCE_MIB", 256)
	root := os.Getenv("GPUCR_BENCH_DIR")
	if root == "" {
		root = "/dev/shm"
	}
	img := thirdsData(64<<20, 5)
	ctx := context.Background()
	for _, spec := range benchCodecs() {
		d, err := os.MkdirTemp(root, "gpucr-bench-*")
		if err != nil {
			b.Fatal(err)
		}
		defer os.RemoveAll(d)
		st := dir.New(d)
		out, err := NewArchiveOutput(ctx, st, 64<<20)
		if err != nil {
			b.Fatal(err)
		}
		c, err := NewCapture(ctx, out, Options{Codec: mustSpec(b, spec)})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := c.WriteFile("pages-1.img", &repeatReader{tmpl: img, n: total}, false); err != nil {
			b.Fatal(err)
		}
		m, err := c.Close(ctx, manifest.Manifest{Tool: "bench"})
		if err != nil {
			b.Fatal(err)
		}
		for _, ra := range benchReadAheads(b) {
			b.Run(fmt.Sprintf("%s/readahead=%d", spec, ra), func(b *testing.B) {
				defer func(v int) { readAhead = v }(readAhead)
				readAhead = ra
				readerCPU.Store(0)
				stageCPU(b, total, false, func() {
					a, err := OpenArchive(ctx, st, Options{})
					if err != nil {
						b.Fatal(err)
					}
					for _, f := range m.Files {
						if err := copyToPipeReader(ctx, a, f); err != nil {
							b.Fatalf("Copy(%s): %v", f.Name, err)
						}
					}
					a.Close()
				})
				b.ReportMetric(float64(readerCPU.Load())/1e9/(float64(total)*float64(b.N)/(1<<30)), "reader-cpu-s/GiB")
			})
		}
	}
}

// benchReadAheads are the read-ahead windows BenchmarkArchiveDirPipe
// compares (GPUCR_BENCH_READAHEAD, chunks; 0 is the default rule).
func benchReadAheads(b *testing.B) []int {
	v := os.Getenv("GPUCR_BENCH_READAHEAD")
	if v == "" {
		return []int{0}
	}
	var ras []int
	for _, f := range strings.Fields(v) {
		n, err := strconv.Atoi(f)
		if err != nil {
			b.Fatalf("GPUCR_BENCH_READAHEAD: %v", err)
		}
		ras = append(ras, n)
	}
	return ras
}

// BenchmarkStreamSpill receives GPUCR_BENCH_SPILL_MIB (default 1024) of
// 4 MiB chunks stored raw (as most of a GPU process's memory goes) on 4
// shards with a 1 MiB budget, so that every chunk spills into
// GPUCR_BENCH_SPILL_DIR (default a temp dir; /dev/shm keeps the disk out):
// into one spill file, and into the default number (min(GOMAXPROCS, 8)).
// The ratio is what several files buy, and grows with cores. Only the
// receive is timed, not the removal of the spilled bytes at Close.
//
//	GPUCR_BENCH_SPILL_DIR=/dev/shm GPUCR_BENCH_SPILL_MIB=4096 go test -run X -bench StreamSpill -benchtime 3x ./streamer/
func BenchmarkStreamSpill(b *testing.B) {
	const chunk, shards = 4 << 20, 4
	total := benchMiB("GPUCR_BENCH_SPILL_MIB", 1024) / (shards * chunk) * (shards * chunk)
	dir := os.Getenv("GPUCR_BENCH_SPILL_DIR")
	if dir == "" {
		dir = b.TempDir()
	}
	type payload struct {
		raw  []byte
		crc  uint32
		hash [32]byte
	}
	payloads := make([]payload, 16)
	for i := range payloads {
		raw := mixedData(chunk, uint64(i))
		payloads[i] = payload{raw, codec.Checksum(raw), codec.ContentHash(raw)}
	}
	// writeShard sends shard i: one file of total/shards bytes.
	writeShard := func(w io.Writer, i int) error {
		mw, err := manifest.NewWriter(w, manifest.Header{ShardCount: shards, StreamID: 9})
		if err != nil {
			return err
		}
		id := uint32(i)
		if _, err := mw.WriteFrame(&manifest.FrameHeader{Type: manifest.FrameFile, FileID: id}, fmt.Appendf(nil, "vram-%d.bin", i)); err != nil {
			return err
		}
		size := total / shards
		var hashes []byte
		for off := int64(0); off < size; off += chunk {
			p := payloads[(off/chunk+int64(i))%int64(len(payloads))]
			fh := manifest.FrameHeader{Type: manifest.FrameData, FileID: id, Offset: uint64(off), RawLen: chunk,
				Codec: uint8(codec.None), Checksum: p.crc, Hash: p.hash}
			if _, err := mw.WriteFrame(&fh, p.raw); err != nil {
				return err
			}
			hashes = append(hashes, p.hash[:]...)
		}
		end := manifest.FrameHeader{Type: manifest.FrameFileEnd, FileID: id, Offset: uint64(size), RawLen: uint32(size / chunk), Hash: FileDigest(hashes, size)}
		if _, err := mw.WriteFrame(&end, nil); err != nil {
			return err
		}
		return mw.Finish(nil)
	}
	defer func(n int) { maxSpillFiles = n }(maxSpillFiles)
	for _, files := range []int{1, min(runtime.GOMAXPROCS(0), maxSpillFiles)} {
		b.Run(fmt.Sprintf("files=%d", files), func(b *testing.B) {
			maxSpillFiles = files
			ctx := context.Background()
			b.SetBytes(total)
			for range b.N {
				readers := make([]io.Reader, shards)
				names := make([]string, shards)
				var senders sync.WaitGroup
				for i := range shards {
					pr, pw := io.Pipe()
					readers[i], names[i] = pr, fmt.Sprintf("shard %d", i)
					senders.Add(1)
					go func() {
						defer senders.Done()
						pw.CloseWithError(writeShard(pw, i))
					}()
				}
				src := NewStreamSource(ctx, readers, names, StreamOptions{Options: Options{MemoryLimit: 1 << 20}, SpillDir: dir})
				err := src.Wait(ctx)
				b.StopTimer()
				for _, r := range readers {
					r.(*io.PipeReader).Close() // a failed receive leaves its senders blocked
				}
				senders.Wait()
				src.mu.Lock()
				used := len(src.spills)
				src.mu.Unlock()
				src.Close()
				if err != nil {
					b.Fatal(err)
				}
				if used != files {
					b.Fatalf("%d spill files, want %d", used, files)
				}
				b.StartTimer()
			}
		})
	}
}
