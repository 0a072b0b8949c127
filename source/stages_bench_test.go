package source

import (
	"encoding/binary"
	"io"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
	"lukechampine.com/blake3"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/streamer"
)

// BenchmarkStages costs each step of a capture on its own, in CPU seconds
// per GiB of image (metric cpu-s/GiB, counted from getrusage, so that a
// busy machine inflates the wall time but not the figure), on the
// capture benchmark's image: a third random, a third zeros, a third text,
// in 4 MiB chunks. Every stage is charged to the whole image, so the
// figures add up: reading CRIU's pipe, the zero test, CRC-32C and BLAKE3
// of the non-zero chunks, lz4, writing the stored chunks to tmpfs, and
// the pipeline (chunking, ordering, hand-offs) with everything above but
// the I/O (reading from memory instead: the copy stage). pipe-to-tmpfs/*
// are not stages but the two copies of a --codec none capture together,
// done two ways, to compare with each other.
func BenchmarkStages(b *testing.B) {
	const chunk = pipeline.DefaultChunkSize
	img := thirdsData(64<<20, 5)
	chunks := make([][]byte, 0, len(img)/chunk)
	for off := 0; off < len(img); off += chunk {
		chunks = append(chunks, img[off:off+chunk])
	}
	nonZero := [][]byte{}
	for _, c := range chunks {
		if !codec.IsZero(c) {
			nonZero = append(nonZero, c)
		}
	}
	perChunk := func(name string, chunks [][]byte, f func([]byte)) {
		b.Run(name, func(b *testing.B) {
			stageCPU(b, int64(len(img)), false, func() {
				for _, c := range chunks {
					f(c)
				}
			})
		})
	}
	b.Run("read-pipe", func(b *testing.B) {
		buf := make([]byte, chunk)
		stageCPU(b, int64(len(img)), true, func() {
			r, wait := criuPipe(b, img)
			for {
				if _, err := io.ReadFull(r, buf); err != nil {
					break
				}
			}
			wait()
		})
	})
	scratch := make([]byte, chunk)
	perChunk("copy", chunks, func(c []byte) { copy(scratch, c) }) // what the pipeline benchmarks read with
	perChunk("zero-test", chunks, func(c []byte) { codec.IsZero(c) })
	perChunk("crc32c", nonZero, func(c []byte) { codec.Checksum(c) })
	perChunk("blake3", nonZero, func(c []byte) { codec.ContentHash(c) })
	perChunk("blake3-sum256", nonZero, func(c []byte) { blake3.Sum256(c) }) // the library's own, goroutine per 16 KiB
	for _, spec := range []string{"lz4", "zstd", "auto"} {
		enc, err := codec.NewEncoder(pipelinetest.MustSpec(b, spec))
		if err != nil {
			b.Fatal(err)
		}
		dst := make([]byte, 0, enc.MaxEncodedLen(chunk))
		perChunk("codec-"+spec, nonZero, func(c []byte) { enc.Encode(dst, c) })
	}
	perChunk("file-digest", [][]byte{make([]byte, 32*len(chunks))}, func(h []byte) { pipeline.FileDigest(h, int64(len(img))) })
	b.Run("write-tmpfs", func(b *testing.B) {
		stageCPU(b, int64(len(img)), true, func() {
			f, remove := stageFile(b)
			defer remove()
			var hdr [manifest.FrameSize]byte
			for _, c := range nonZero {
				f.Write(hdr[:])
				f.Write(c)
			}
		})
	})
	// The two copies a --codec none capture makes, end to end on one
	// thread, against the one lever left: splice the chunk from CRIU's pipe
	// into the file and check it through a mapping of the file afterwards.
	b.Run("pipe-to-tmpfs/read-check-write", func(b *testing.B) {
		buf := make([]byte, chunk)
		pipeToTmpfs(b, img, func(r *os.File, f *os.File, off int64) (int64, error) {
			if _, err := io.ReadFull(r, buf); err != nil {
				return 0, err
			}
			if codec.IsZero(buf) {
				return off, nil
			}
			codec.Checksum(buf)
			var hdr [manifest.FrameSize]byte
			if _, err := f.WriteAt(hdr[:], off); err != nil {
				return 0, err
			}
			_, err := f.WriteAt(buf, off+manifest.FrameSize)
			return off + manifest.FrameSize + chunk, err
		})
	})
	b.Run("pipe-to-tmpfs/splice-then-map", func(b *testing.B) {
		pipeToTmpfs(b, img, func(r *os.File, f *os.File, off int64) (int64, error) {
			at := off + manifest.FrameSize
			for left, o := chunk, at; left > 0; {
				n, err := unix.Splice(int(r.Fd()), nil, int(f.Fd()), &o, left, unix.SPLICE_F_MOVE)
				if err != nil {
					return 0, err
				}
				if n == 0 {
					return 0, io.ErrUnexpectedEOF
				}
				left -= int(n)
			}
			page := at &^ 4095
			m, err := unix.Mmap(int(f.Fd()), page, int(at-page)+chunk, unix.PROT_READ, unix.MAP_SHARED)
			if err != nil {
				return 0, err
			}
			c := m[at-page:]
			zero := codec.IsZero(c)
			if !zero {
				codec.Checksum(c)
			}
			unix.Munmap(m)
			if zero {
				return off, nil // the next chunk goes over it
			}
			var hdr [manifest.FrameSize]byte
			_, err = f.WriteAt(hdr[:], off)
			return at + chunk, err
		})
	})
	for _, spec := range []string{"none", "lz4"} {
		b.Run("pipeline-"+spec, func(b *testing.B) {
			// A GiB per capture: its buffers are allocated once, as in
			// a real one.
			opts, total := pipeline.Options{Codec: pipelinetest.MustSpec(b, spec)}, int64(1<<30)
			stageCPU(b, total, false, func() {
				out, _ := streamer.NewStreamOutput([]io.Writer{io.Discard})
				c, err := streamer.NewCapture(b.Context(), out, opts)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := c.WriteFile("pages-1.img", &pipelinetest.RepeatReader{Tmpl: img, N: total}, false); err != nil {
					b.Fatal(err)
				}
				if _, err := c.Close(b.Context(), manifest.Manifest{}); err != nil {
					b.Fatal(err)
				}
			})
		})
	}
}

// stageCPU runs f b.N times and reports its CPU time per GiB of image:
// of this thread alone when thread is set (f's helpers excluded), else of
// the whole process.
func stageCPU(b *testing.B, imageBytes int64, thread bool, f func()) {
	who := syscall.RUSAGE_SELF
	if thread {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		who = unix.RUSAGE_THREAD
	}
	cpu := func() float64 {
		var ru syscall.Rusage
		syscall.Getrusage(who, &ru)
		return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
	}
	b.SetBytes(imageBytes)
	b.ResetTimer()
	c0 := cpu()
	for range b.N {
		f()
	}
	used := cpu() - c0
	b.StopTimer()
	b.ReportMetric(used/(float64(imageBytes)*float64(b.N)/(1<<30)), "cpu-s/GiB")
}

// pipeToTmpfs feeds img into a pipe as CRIU does (page references) and
// charges this thread for moving it into a tmpfs file, chunk by chunk,
// with step (which returns where the next chunk goes).
func pipeToTmpfs(b *testing.B, img []byte, step func(r, f *os.File, off int64) (int64, error)) {
	stageCPU(b, int64(len(img)), true, func() {
		f, remove := stageFile(b)
		defer remove()
		r, wait := criuPipe(b, img)
		off := int64(0)
		for range len(img) / pipeline.DefaultChunkSize {
			var err error
			if off, err = step(r, f, off); err != nil {
				b.Error(err)
				break
			}
		}
		wait()
	})
}

// stageFile creates the file a stage writes, in GPUCR_BENCH_DIR (default
// /dev/shm, where the captures it stands for write); remove deletes it.
func stageFile(b *testing.B) (f *os.File, remove func()) {
	dir := os.Getenv("GPUCR_BENCH_DIR")
	if dir == "" {
		dir = "/dev/shm"
	}
	f, err := os.CreateTemp(dir, "gpucr-stage-*")
	if err != nil {
		b.Fatal(err)
	}
	return f, func() {
		f.Close()
		os.Remove(f.Name())
	}
}

// criuPipe returns a pipe that a goroutine fills with img as CRIU's splice
// does (references to its pages), and wait, which closes the read end and
// waits for that goroutine.
func criuPipe(b *testing.B, img []byte) (r *os.File, wait func()) {
	r, w, err := os.Pipe()
	if err != nil {
		b.Fatal(err)
	}
	pipeline.GrowPipe(w.Fd())
	var wg sync.WaitGroup
	wg.Go(func() {
		defer w.Close()
		rc, _ := w.SyscallConn()
		if _, err := (chunkWriter{w: w, pipe: rc}).vmsplice(img); err != nil {
			b.Error(err)
		}
	})
	return r, func() {
		r.Close()
		wg.Wait()
	}
}

// thirdsData is n bytes in 4 MiB runs of random bytes, zeros and text, a
// third each (the image of the capture benchmarks and of `bench.sh`'s
// thirds target).
func thirdsData(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, seed+1))
	words := strings.Fields("the model layer attention weight token batch request tensor device memory restore checkpoint stream process kernel cache")
	b := make([]byte, n)
	for off := 0; off < n; off += pipeline.DefaultChunkSize {
		c := b[off:min(n, off+pipeline.DefaultChunkSize)]
		switch (off / pipeline.DefaultChunkSize) % 3 {
		case 0:
			for i := 0; i+8 <= len(c); i += 8 {
				binary.LittleEndian.PutUint64(c[i:], r.Uint64())
			}
		case 2:
			for i := 0; i < len(c); {
				w := words[r.IntN(len(words))]
				if r.IntN(4) == 0 {
					w += " " + strconv.Itoa(r.IntN(100000))
				}
				i += copy(c[i:], w+" ")
			}
		}
	}
	return b
}
