package cisformat

import (
	"context"
	"io"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/testwait"
)

// A criu-image-streamer stream that writes one file again and again under
// a 4,000-byte name (each copy replacing the last) leaves the reader
// holding about one name while it reads (issue 25 M-a: 250,000 copies
// held 1.3 GB under a 64 MiB limit). 20,000 copies are 80 MB of names.
func TestReplacedNamesNotHeld(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
	defer cancel()
	const n, limit = 20000, 8 << 20
	heap := func() int64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return int64(ms.HeapAlloc)
	}
	before, held := heap(), int64(0)
	pr, pw := io.Pipe()
	go func() {
		name := strings.Repeat("n", 4000)
		var seq uint64
		marker := func(m Marker) error {
			m.Seq, seq = seq, seq+1
			_, err := pw.Write(AppendMarker(nil, m))
			return err
		}
		for range n {
			if err := marker(Marker{Kind: Filename, Name: name}); err != nil {
				return
			}
			if err := marker(Marker{Kind: FileEOF}); err != nil {
				return
			}
		}
		held = heap() - before // every copy read, the reader still running
		pw.CloseWithError(marker(Marker{Kind: ImageEOF}))
	}()
	src := NewSource(ctx, []io.Reader{pr}, []string{"pipe"}, nil, source.StreamSourceOptions{Options: pipeline.Options{MemoryLimit: limit}, Discard: true})
	defer src.Close()
	files, err := src.Files(ctx)
	if err != nil || len(files) != 1 {
		t.Fatalf("Files = %d files, %v; want the last copy only", len(files), err)
	}
	if held > 2*limit {
		t.Fatalf("the reader held %d bytes after %d replaced files, more than twice its %d-byte budget", held, n, limit)
	}
}
