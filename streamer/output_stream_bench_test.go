package streamer

import (
	"context"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
)

// linkWriter takes bytes at rate bytes per second, like a link (or a
// disk) of its own: it sleeps instead of using a core, so that what the
// writes overlap shows on a machine of few cores too.
type linkWriter struct {
	rate float64
	owed time.Duration
}

func (w *linkWriter) Write(p []byte) (int, error) {
	w.owed += time.Duration(float64(len(p)) / w.rate * float64(time.Second))
	if w.owed > time.Millisecond {
		time.Sleep(w.owed)
		w.owed = 0
	}
	return len(p), nil
}

// BenchmarkStreamOutputShards writes GPUCR_BENCH_MIB (default 1024) of
// 4 MiB DATA frames into a StreamOutput of 1, 2, 4 or 8 shards, the
// synchronous way (WriteFrame: one shard after the other on the caller's
// goroutine) and the asynchronous one (WriteFrameAsync: each shard on its
// own). sink=pipe: each shard is a pipe that a goroutine drains (a memory
// copy per byte, as into a socket); sink=link: each shard takes 1 GB/s
// and sleeps for it.
func BenchmarkStreamOutputShards(b *testing.B) {
	size := pipelinetest.BenchMiB("GPUCR_BENCH_MIB", 1024)
	payload := make([]byte, 4<<20)
	pipelinetest.FillRandom(payload, pipelinetest.NewRand(5))
	for _, sink := range []string{"pipe", "link"} {
		for _, shards := range []int{1, 2, 4, 8} {
			for _, async := range []bool{false, true} {
				mode := map[bool]string{false: "sync", true: "async"}[async]
				b.Run(fmt.Sprintf("sink=%s/shards=%d/write=%s", sink, shards, mode), func(b *testing.B) {
					b.SetBytes(size)
					for range b.N {
						writeShards(b, sink, shards, async, size, payload)
					}
				})
			}
		}
	}
}

func writeShards(b *testing.B, sink string, shards int, async bool, size int64, payload []byte) {
	ctx := context.Background()
	ws := make([]io.Writer, shards)
	var drains sync.WaitGroup
	var pws []*io.PipeWriter
	for i := range ws {
		if sink == "link" {
			ws[i] = &linkWriter{rate: 1e9}
			continue
		}
		pr, pw := io.Pipe()
		ws[i], pws = pw, append(pws, pw)
		drains.Add(1)
		go func() {
			defer drains.Done()
			buf := make([]byte, 1<<20)
			for {
				if _, err := pr.Read(buf); err != nil {
					return
				}
			}
		}()
	}
	o, err := NewStreamOutput(ws)
	if err != nil {
		b.Fatal(err)
	}
	var man manifest.Manifest
	for off := int64(0); off < size; off += int64(len(payload)) {
		fh := manifest.FrameHeader{Type: manifest.FrameData, FileID: 1, Offset: uint64(off), RawLen: uint32(len(payload)), StoredLen: uint32(len(payload))}
		if async {
			_, err = o.WriteFrameAsync(ctx, &fh, payload, func(err error) {
				if err != nil {
					b.Error(err)
				}
			})
		} else {
			_, err = o.WriteFrame(ctx, &fh, payload)
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	if err := o.Commit(ctx, &man); err != nil {
		b.Fatal(err)
	}
	for _, pw := range pws {
		pw.Close()
	}
	drains.Wait()
}
