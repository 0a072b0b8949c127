package source

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/scratch"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/streamer"
)

func BenchmarkStreamSource(b *testing.B) {
	total := pipelinetest.BenchMiB("GPUCR_BENCH_SOURCE_MIB", 256)
	for _, spec := range pipelinetest.BenchCodecs() {
		b.Run(spec, func(b *testing.B) { benchStreamSource(b, spec, total, nil, nil) })
	}
}

// benchStreamSource captures total bytes of benchmark data as a stream
// (sealed under seal when it is set) and serves it, b.N times, the way a
// restore reads a stream: served early, every file copied as it
// completes, held in memory (no spill); key opens it.
func benchStreamSource(b *testing.B, spec string, total int64, seal *crypt.Session, key *crypt.Key) {
	stream, m := benchStream(b, spec, total, pipeline.Format{Seal: seal})
	ctx := context.Background()
	b.SetBytes(total)
	b.ResetTimer()
	for range b.N {
		src := NewStreamSource(ctx, []io.Reader{bytes.NewReader(stream)}, []string{"bench"},
			StreamSourceOptions{Options: pipeline.Options{MemoryLimit: 2 * total, Key: key}, ServeEarly: true})
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
	b.ReportMetric(float64(len(stream))/float64(total), "stored/raw")
}

// benchStream captures total bytes of benchmark data as a one-shard
// stream written in f.
func benchStream(b *testing.B, spec string, total int64, f pipeline.Format) ([]byte, *manifest.Manifest) {
	var buf bytes.Buffer
	out, err := streamer.NewStreamOutputAs([]io.Writer{&buf}, f)
	if err != nil {
		b.Fatal(err)
	}
	m := pipelinetest.CaptureBench(b, total)(streamer.NewCapture(context.Background(), out, pipeline.Options{Codec: pipelinetest.MustSpec(b, spec)}))
	return buf.Bytes(), m
}

// benchArchive captures total bytes of benchmark data into an archive.
func benchArchive(b *testing.B, spec string, total int64) (*mem.Store, *manifest.Manifest) {
	store := mem.New("bench")
	out, err := streamer.NewArchiveOutput(context.Background(), store, 64<<20)
	if err != nil {
		b.Fatal(err)
	}
	return store, pipelinetest.CaptureBench(b, total)(streamer.NewCapture(context.Background(), out, pipeline.Options{Codec: pipelinetest.MustSpec(b, spec)}))
}

func BenchmarkArchiveSource(b *testing.B) {
	total := pipelinetest.BenchMiB("GPUCR_BENCH_SOURCE_MIB", 256)
	for _, spec := range pipelinetest.BenchCodecs() {
		b.Run(spec, func(b *testing.B) {
			ctx := context.Background()
			store, m := benchArchive(b, spec, total)
			b.SetBytes(total)
			b.ResetTimer()
			for range b.N {
				a, err := OpenArchive(ctx, store, pipeline.Options{})
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
	total := pipelinetest.BenchMiB("GPUCR_BENCH_SOURCE_MIB", 256)
	for _, spec := range pipelinetest.BenchCodecs() {
		store, m := benchArchive(b, spec, total)
		benchIntoPipe(b, spec, total, m.Files, func() (Source, error) {
			return OpenArchive(context.Background(), store, pipeline.Options{})
		})
	}
}

// BenchmarkStreamSourcePipe decodes a stream (as receive does) and serves
// it into a pipe read by another goroutine: by write(2), and by vmsplice(2).
func BenchmarkStreamSourcePipe(b *testing.B) {
	total := pipelinetest.BenchMiB("GPUCR_BENCH_SOURCE_MIB", 256)
	for _, spec := range pipelinetest.BenchCodecs() {
		stream, m := benchStream(b, spec, total, pipeline.Format{})
		benchIntoPipe(b, spec, total, m.Files, func() (Source, error) {
			return NewStreamSource(context.Background(), []io.Reader{bytes.NewReader(stream)}, []string{"bench"},
				StreamSourceOptions{Options: pipeline.Options{MemoryLimit: 2 * total}}), nil
		})
	}
}

// BenchmarkStreamSourceBorrowed is the receiver's side of a pre-copy
// migration's final dump, whose frames go by reference to the chunk cache:
// a codec-none stream decoded and served into pipes read by other
// goroutines (vmsplice), its payloads read into the source's page buffers
// ("read": frames sent whole, and REF frames before the cache's bytes were
// taken as they are) or taken as the reader's memory ("borrowed").
func BenchmarkStreamSourceBorrowed(b *testing.B) {
	total := pipelinetest.BenchMiB("GPUCR_BENCH_SOURCE_MIB", 256)
	stream, m := benchStream(b, "none", total, pipeline.Format{})
	ctx := context.Background()
	for _, mode := range []string{"read", "borrowed"} {
		b.Run(mode, func(b *testing.B) {
			stageCPU(b, total, false, func() {
				var r io.Reader = bytes.NewReader(stream)
				if mode == "borrowed" {
					r = &lendingShard{Reader: bytes.NewReader(stream), b: stream}
				}
				src := NewStreamSource(ctx, []io.Reader{r}, []string{"bench"}, StreamSourceOptions{Options: pipeline.Options{MemoryLimit: 2 * total}, ServeEarly: true})
				var wg sync.WaitGroup
				for _, f := range m.Files {
					wg.Add(1)
					go func() {
						defer wg.Done()
						if err := copyToPipeReader(ctx, src, f); err != nil {
							b.Errorf("Copy(%s): %v", f.Name, err)
						}
					}()
				}
				wg.Wait()
				src.Close()
			})
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
	pipeline.GrowPipe(w.Fd())
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
	total := pipelinetest.BenchMiB("GPUCR_BENCH_SOURCE_MIB", 256)
	root := os.Getenv("GPUCR_BENCH_DIR")
	if root == "" {
		root = "/dev/shm"
	}
	img := thirdsData(64<<20, 5)
	ctx := context.Background()
	for _, spec := range pipelinetest.BenchCodecs() {
		d, err := os.MkdirTemp(root, "gpucr-bench-*")
		if err != nil {
			b.Fatal(err)
		}
		defer os.RemoveAll(d)
		st := dir.New(d)
		out, err := streamer.NewArchiveOutput(ctx, st, 64<<20)
		if err != nil {
			b.Fatal(err)
		}
		c, err := streamer.NewCapture(ctx, out, pipeline.Options{Codec: pipelinetest.MustSpec(b, spec)})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := c.WriteFile("pages-1.img", &pipelinetest.RepeatReader{Tmpl: img, N: total}, false); err != nil {
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
					a, err := OpenArchive(ctx, st, pipeline.Options{})
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
	total := pipelinetest.BenchMiB("GPUCR_BENCH_SPILL_MIB", 1024) / (shards * chunk) * (shards * chunk)
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
		raw := pipelinetest.MixedData(chunk, uint64(i))
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
		end := manifest.FrameHeader{Type: manifest.FrameFileEnd, FileID: id, Offset: uint64(size), RawLen: uint32(size / chunk), Hash: pipeline.FileDigest(hashes, size)}
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
				src := NewStreamSource(ctx, readers, names, StreamSourceOptions{Options: pipeline.Options{MemoryLimit: 1 << 20}, SpillDir: dir})
				err := src.Wait(ctx)
				b.StopTimer()
				for _, r := range readers {
					r.(*io.PipeReader).Close() // a failed receive leaves its senders blocked
				}
				senders.Wait()
				src.mu.Lock()
				used := len(src.spill.files)
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

// BenchmarkStreamCopyToFile writes a held stream's files into files
// where a lazy restore's extract writes them, by Copy (one writer) and
// by CopyToFile (a shared mapping, several writers), the source decoded
// once before the timer. GPUCR_BENCH_SOURCE_MIB sets the size (256).
func BenchmarkStreamCopyToFile(b *testing.B) {
	total := pipelinetest.BenchMiB("GPUCR_BENCH_SOURCE_MIB", 256)
	stream, m := benchStream(b, "lz4", total, pipeline.Format{})
	ctx := context.Background()
	src := NewStreamSource(ctx, []io.Reader{bytes.NewReader(stream)}, []string{"bench"}, StreamSourceOptions{Options: pipeline.Options{MemoryLimit: 2 * total}})
	defer src.Close()
	if err := src.Wait(ctx); err != nil {
		b.Fatal(err)
	}
	// Where a lazy restore writes: a tmpfs of huge pages of its own (as
	// root), else $TMPDIR.
	sd, err := scratch.New(scratch.DefaultRoot, "", "gcs-bench-", 2*total)
	if err != nil {
		b.Fatal(err)
	}
	defer sd.Remove()
	b.Logf("files in %s (%s)", sd.Path, map[bool]string{true: "a tmpfs of huge pages", false: sd.Why}[sd.Mounted])
	dir := sd.Path
	for _, mode := range []string{"copy", "mapped"} {
		b.Run(mode, func(b *testing.B) {
			b.SetBytes(total)
			for range b.N {
				for _, f := range m.Files {
					w, err := os.Create(filepath.Join(dir, f.Name))
					if err != nil {
						b.Fatal(err)
					}
					if mode == "copy" {
						_, err = src.Copy(ctx, f.Name, w)
					} else {
						_, err = src.CopyToFile(ctx, f.Name, w)
					}
					w.Close()
					if err != nil {
						b.Fatal(err)
					}
					os.Remove(w.Name())
				}
			}
		})
	}
}
