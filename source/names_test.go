package source

import (
	"context"
	"errors"
	"io"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/testwait"
)

// replacingStream writes, into a pipe, a stream that opens and ends the
// same empty file n times under one 4,000-byte name: each copy replaces
// the one before (issue 25 M-a). Before the END frame it calls atEnd,
// once the reader has read every other frame and is still alive.
func replacingStream(n int, atEnd func()) io.Reader {
	pr, pw := io.Pipe()
	go func() {
		w, err := manifest.NewWriter(pw, manifest.Header{ShardCount: 1, StreamID: 7})
		if err != nil {
			pw.CloseWithError(err)
			return
		}
		name := []byte(strings.Repeat("n", 4000))
		empty := pipeline.FileDigest(nil, 0)
		for i := range uint32(n) {
			if _, err := w.WriteFrame(&manifest.FrameHeader{Type: manifest.FrameFile, FileID: i}, name); err != nil {
				pw.CloseWithError(err)
				return
			}
			if _, err := w.WriteFrame(&manifest.FrameHeader{Type: manifest.FrameFileEnd, FileID: i, Hash: empty}, nil); err != nil {
				pw.CloseWithError(err)
				return
			}
		}
		if err := w.Flush(); err != nil { // a pipe: returns once read
			pw.CloseWithError(err)
			return
		}
		if atEnd != nil {
			atEnd()
		}
		pw.CloseWithError(w.Finish(nil))
	}()
	return pr
}

// heapInUse is the live heap after a collection.
func heapInUse() int64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// The names of replaced files are not held: 20,000 copies of a file with a
// 4,000-byte name (80 MB of names) leave the source holding about one,
// within its budget, while it reads. Before, the frame reader kept every
// name until the stream ended: the heap grew by the whole 80 MB.
func TestStreamReplacedNamesNotHeld(t *testing.T) {
	if testing.Short() && raceEnabled {
		t.Skip("80 MB stream under the race detector")
	}
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
	defer cancel()
	const n, limit = 20000, 8 << 20
	before, held := heapInUse(), int64(0)
	src := NewStreamSource(ctx, []io.Reader{replacingStream(n, func() { held = heapInUse() - before })}, []string{"pipe"},
		StreamSourceOptions{Options: pipeline.Options{MemoryLimit: limit}, Discard: true})
	defer src.Close()
	if err := src.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	files, err := src.Files(ctx)
	if err != nil || len(files) != 1 {
		t.Fatalf("Files = %d files, %v; want the last copy only", len(files), err)
	}
	if held > 2*limit {
		t.Fatalf("the source holds %d bytes after %d replaced files, more than twice its %d-byte budget", held, n, limit)
	}
}

// What outlives a replaced file (its id, kept for lagging shards) is
// counted against the budget: enough replacements are refused, not held.
func TestStreamReplacedIDsCounted(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	const limit = 64 << 10
	src := NewStreamSource(ctx, []io.Reader{replacingStream(2*limit/doneMeta, nil)}, []string{"pipe"},
		StreamSourceOptions{Options: pipeline.Options{MemoryLimit: limit}, Discard: true})
	defer src.Close()
	if err := src.Wait(ctx); !errors.Is(err, ErrMemoryLimit) {
		t.Fatalf("Wait = %v, want ErrMemoryLimit", err)
	}
}
