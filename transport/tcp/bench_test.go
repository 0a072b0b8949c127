package tcp

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/testwait"
)

// BenchmarkTCPTransfer moves 256 MiB of incompressible data through a
// capture, the TCP transport over loopback and a receiving stream source:
// the transport's own throughput, without CRIU.
func BenchmarkTCPTransfer(b *testing.B) {
	const size = 256 << 20
	block := make([]byte, 4<<20)
	rand.Read(block)
	spec, _ := codec.ParseSpec("none")
	for _, streams := range []int{1, 2, 4} {
		b.Run(fmt.Sprint(streams), func(b *testing.B) {
			b.SetBytes(size)
			for range b.N {
				ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
				l, err := Listen(ctx, "127.0.0.1:0", ListenOptions{Auth: tokenAuth(goodToken)})
				if err != nil {
					b.Fatal(err)
				}
				src := NewSource(ctx, l, source.StreamSourceOptions{Options: pipeline.Options{MemoryLimit: 1 << 30}})
				out, err := Dial(ctx, l.Addr().String(), SendOptions{Auth: tokenAuth(goodToken), Streams: streams, AutoCommit: true})
				if err != nil {
					b.Fatal(err)
				}
				c, err := streamer.NewCapture(ctx, out, pipeline.Options{Codec: spec})
				if err != nil {
					b.Fatal(err)
				}
				r, w := io.Pipe()
				go func() {
					for n := 0; n < size; n += len(block) {
						w.Write(block)
					}
					w.Close()
				}()
				if _, err := c.WriteFile("pages-1.img", r, false); err != nil {
					b.Fatal(err)
				}
				if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
					b.Fatal(err)
				}
				if _, err := src.WaitCommitted(ctx); err != nil {
					b.Fatal(err)
				}
				src.Close()
				out.Close()
				cancel()
			}
		})
	}
}

// migrateSize is what BenchmarkMigrateTransfer moves: GPUCR_BENCH_MIB
// (default 1024; the GPU host's fast path moves about 13 GiB).
func migrateSize() int64 {
	if v, err := strconv.Atoi(os.Getenv("GPUCR_BENCH_MIB")); err == nil && v > 0 {
		return int64(v) << 20
	}
	return 1 << 30
}

// syncOutput hides WriteFrameAsync: the capture writes every frame on its
// one ordered writer, as before the asynchronous StreamOutput.
type syncOutput struct{ streamer.Output }

func (s syncOutput) Format() pipeline.Format {
	if o, ok := s.Output.(interface{ Format() pipeline.Format }); ok {
		return o.Format()
	}
	return pipeline.Format{}
}

// BenchmarkMigrateTransfer is migrate's transfer without CRIU or a GPU:
// four files of incompressible data (the fast path stores its VRAM files
// at once) through a capture (codec none) into the TCP output over
// loopback, teed into a local copy as migrate keeps it (keep=file, in
// $TMPDIR), to a receiver that holds everything in memory. write=sync
// writes every frame on the capture's one writer, write=async each shard
// (and the copy) on its own.
func BenchmarkMigrateTransfer(b *testing.B) {
	size := migrateSize()
	block := make([]byte, 4<<20)
	rand.Read(block)
	spec, _ := codec.ParseSpec("none")
	for _, keep := range []bool{false, true} {
		for _, streams := range []int{1, 2, 4, 8} {
			for _, async := range []bool{false, true} {
				name := fmt.Sprintf("keep=%v/streams=%d/write=%s", keep, streams, map[bool]string{false: "sync", true: "async"}[async])
				b.Run(name, func(b *testing.B) {
					b.SetBytes(size)
					for range b.N {
						migrateOnce(b, size, block, spec, streams, keep, async)
					}
				})
			}
		}
	}
}

func migrateOnce(b *testing.B, size int64, block []byte, spec codec.Spec, streams int, keep, async bool) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(10*time.Minute))
	defer cancel()
	l, err := Listen(ctx, "127.0.0.1:0", ListenOptions{Auth: tokenAuth(goodToken)})
	if err != nil {
		b.Fatal(err)
	}
	src := NewSource(ctx, l, source.StreamSourceOptions{Options: pipeline.Options{MemoryLimit: size + 512<<20}})
	defer src.Close()
	out, err := Dial(ctx, l.Addr().String(), SendOptions{Auth: tokenAuth(goodToken), Streams: streams, AutoCommit: true})
	if err != nil {
		b.Fatal(err)
	}
	defer out.Close()
	var o streamer.Output = out
	if keep {
		f, err := os.CreateTemp("", "gpucr-bench-keep-*.stream")
		if err != nil {
			b.Fatal(err)
		}
		defer os.Remove(f.Name())
		defer f.Close()
		k, err := streamer.NewStreamOutput([]io.Writer{f})
		if err != nil {
			b.Fatal(err)
		}
		o = streamer.TeeOutput{Primary: out, Copy: k}
	}
	if !async {
		o = syncOutput{o}
	}
	c, err := streamer.NewCapture(ctx, o, pipeline.Options{Codec: spec})
	if err != nil {
		b.Fatal(err)
	}
	const files = 4
	var wg sync.WaitGroup
	errs := make([]error, files)
	for i := range files {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = c.WriteFile(fmt.Sprintf("vram-%d.bin", i), &blockReader{block: block, left: size / files}, true)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		b.Fatal(err)
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		b.Fatal(err)
	}
	if _, err := src.WaitCommitted(ctx); err != nil {
		b.Fatal(err)
	}
}

// blockReader reads block over and over, left bytes in all.
type blockReader struct {
	block []byte
	off   int
	left  int64
}

func (r *blockReader) Read(p []byte) (int, error) {
	if r.left == 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > r.left {
		p = p[:r.left]
	}
	n := copy(p, r.block[r.off:])
	r.off = (r.off + n) % len(r.block)
	r.left -= int64(n)
	return n, nil
}

// BenchmarkPrecopyFinal is the receiver's side of a pre-copy migration's
// final dump, the part in the downtime: every chunk was sent ahead in a
// round (not timed), and the final stream names them all by reference;
// timed from the final stream's start until every file has been served.
// The image is a quarter each noise and text-like bytes, twice (lz4).
func BenchmarkPrecopyFinal(b *testing.B) {
	size := int(migrateSize())
	img := make([]byte, size)
	rand.Read(img[:size/4])
	for i := size / 4; i < size/2; i++ {
		img[i] = "gpucr-stream pre-copy "[i%22]
	}
	copy(img[size/2:], img[:size/2])
	files := map[string][]byte{"pages-1.img": img[:size/2], "pages-2.img": img[size/2:]}
	for _, streams := range []int{1, 2, 4} {
		b.Run(fmt.Sprintf("streams=%d", streams), func(b *testing.B) {
			b.SetBytes(int64(size))
			for range b.N {
				b.StopTimer()
				l, err := Listen(testCtx(b), "127.0.0.1:0", ListenOptions{Auth: tokenAuth(goodToken), Reports: true,
					ChunkCache: true, CacheMemory: int64(size) * 2, SpillDir: b.TempDir()})
				if err != nil {
					b.Fatal(err)
				}
				src := NewSource(testCtx(b), l, source.StreamSourceOptions{Options: pipeline.Options{MemoryLimit: int64(size) + 256<<20}, SpillDir: b.TempDir()})
				out, err := Dial(testCtx(b), l.Addr().String(), SendOptions{Auth: tokenAuth(goodToken), Streams: streams,
					Format: pipeline.Format{ChunkHashes: true}})
				if err != nil {
					b.Fatal(err)
				}
				if err := send(b, &AheadOutput{Out: out}, files); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				if err := send(b, RefOutput{Output: out, Skip: true}, files); err != nil {
					b.Fatal(err)
				}
				if err := out.Confirm(testCtx(b), CommitInfo{}); err != nil {
					b.Fatal(err)
				}
				if _, err := src.WaitCommitted(testCtx(b)); err != nil {
					b.Fatal(err)
				}
				for name := range files {
					if _, err := src.Copy(testCtx(b), name, io.Discard); err != nil {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				if out.RefBytes() < int64(size)/2 {
					b.Fatalf("only %d of %d bytes went by reference", out.RefBytes(), size)
				}
				out.Close()
				src.Close()
			}
		})
	}
}
