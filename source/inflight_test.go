package source

import (
	"bytes"
	"context"
	"io"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/streamer"
)

// DATA frames in flight count against --memory-limit (issue 25 L1): a
// stream of 8 MiB chunks read by eight decoders under a 16 MiB limit holds
// a quarter of it in flight (or, the frames being larger, one frame being
// read and one decoded), in verify and in restore. Without the budget the
// reader, the decoders' queue and the decoders held 52 to 92 MB here. One
// frame being read per shard is what it cannot bound (inflight.go).
func TestStreamInflightCounted(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
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
		src := NewStreamSource(ctx, []io.Reader{bytes.NewReader(buf.Bytes())}, []string{"buf"}, StreamOptions{Options: pipeline.Options{Workers: 8, MemoryLimit: limit}, Discard: discard, SpillDir: t.TempDir()})
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
