package source

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/testwait"
)

// DATA frames in flight count against --memory-limit (issue 25 L1): a
// stream of 8 MiB chunks read by eight decoders under a 16 MiB limit holds
// a quarter of it in flight (or, the frames being larger, one frame being
// read and one decoded), in verify and in restore. Without the budget the
// reader, the decoders' queue and the decoders held 52 to 92 MB here. One
// frame being read per shard is what it cannot bound (inflight.go).
func TestStreamInflightCounted(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
	defer cancel()
	const chunk, limit = 8 << 20, 16 << 20
	files := map[string][]byte{"pages-1.img": pipelinetest.MixedData(8*chunk, 3)}
	var buf bytes.Buffer
	out, err := streamer.NewStreamOutput([]io.Writer{&buf})
	if err != nil {
		t.Fatal(err)
	}
	captureFiles(t, ctx, out, pipeline.Options{ChunkSize: chunk, Workers: 4, Codec: pipelinetest.MustSpec(t, "lz4")}, files)
	for _, discard := range []bool{true, false} {
		src := NewStreamSource(ctx, []io.Reader{bytes.NewReader(buf.Bytes())}, []string{"buf"}, StreamSourceOptions{Options: pipeline.Options{Workers: 8, MemoryLimit: limit}, Discard: discard, SpillDir: t.TempDir()})
		err := src.Wait(ctx)
		src.Close()
		if err != nil {
			t.Fatal(err)
		}
		frame := int64(2 * chunk) // stored and raw
		if got, want := src.inflight.peak, max(int64(limit/4), 2*frame); got > want {
			t.Errorf("discard %v: %d bytes in flight, want at most %d", discard, got, want)
		}
	}
}

// Frames that find no room while only frames still being read hold it go
// to spill-file buffers instead of past the budget (issue 25 L1: 16 shards
// of 64 MiB chunks held 930 MB under 16 MiB). Here 16 shards of 4 MiB lz4
// and raw chunks, read at once under a 16 MiB limit: the frames reserved
// stay within its quarter, the rest spill, and every file is served right.
func TestStreamInflightManyShards(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
	defer cancel()
	const chunk, limit, shards = 4 << 20, 16 << 20, 16
	for _, spec := range []string{"lz4", "none"} {
		files := map[string][]byte{}
		for i := range 4 {
			files[fmt.Sprintf("pages-%d.img", i+1)] = pipelinetest.MixedData(8*chunk, uint64(i+1))
		}
		bufs := make([]bytes.Buffer, shards)
		ws := make([]io.Writer, shards)
		for i := range bufs {
			ws[i] = &bufs[i]
		}
		out, err := streamer.NewStreamOutput(ws)
		if err != nil {
			t.Fatal(err)
		}
		captureFiles(t, ctx, out, pipeline.Options{ChunkSize: chunk, Workers: 4, Codec: pipelinetest.MustSpec(t, spec)}, files)
		readers := make([]io.Reader, shards)
		names := make([]string, shards)
		for i := range bufs {
			readers[i], names[i] = bytes.NewReader(bufs[i].Bytes()), fmt.Sprintf("shard%d", i)
		}
		src := NewStreamSource(ctx, readers, names, StreamSourceOptions{Options: pipeline.Options{Workers: 4, MemoryLimit: limit}, SpillDir: t.TempDir()})
		results := make(chan copyResult, len(files))
		for name := range files {
			go func() {
				var buf bytes.Buffer
				_, err := src.Copy(ctx, name, &buf)
				results <- copyResult{name, buf.Bytes(), err}
			}()
		}
		err = src.Wait(ctx)
		for range files {
			c := <-results
			if c.err != nil || !bytes.Equal(c.data, files[c.name]) {
				t.Errorf("%s: %s served %d bytes (want %d), err %v", spec, c.name, len(c.data), len(files[c.name]), c.err)
			}
		}
		src.Close()
		if err != nil {
			t.Fatal(err)
		}
		if got, want := src.inflight.peak, int64(limit/4); got > want {
			t.Errorf("%s: %d bytes of frames held in memory, want at most %d", spec, got, want)
		}
		if src.inflight.spilled == 0 {
			t.Errorf("%s: no frame went to a spill file", spec)
		}
	}
}
