package source

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/testwait"
)

// Sources stop on cancel too.
func TestSourcesCancel(t *testing.T) {
	ctx := context.Background()
	ac := newArchiveCorpus(t, "zstd")
	base := pipelinetest.CountGoroutines()
	a, err := OpenArchive(ctx, slowStore{ac.store}, pipeline.Options{Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	time.AfterFunc(50*time.Millisecond, cancel)
	if _, err := a.Copy(cctx, "pages-1.img", io.Discard); !errors.Is(err, context.Canceled) {
		t.Fatalf("ArchiveSource.Copy after cancel = %v", err)
	}
	pipelinetest.WaitGoroutines(t, base)

	// A StreamSource over a finished stream stops when its context ends.
	sc := newStreamCorpus(t, "lz4")
	base = pipelinetest.CountGoroutines()
	cctx, cancel = context.WithCancel(ctx)
	src := NewStreamSource(cctx, []io.Reader{&slowReader{b: sc.b}}, []string{"slow"}, StreamSourceOptions{Options: pipeline.Options{Workers: 2}})
	cancel()
	if err := src.Wait(ctx); err == nil {
		t.Fatal("Wait after cancel succeeded")
	}
	src.Close()
	pipelinetest.WaitGoroutines(t, base)
}

// A StreamSource whose shard blocks (a pipe that stays open) must still
// stop on cancel and on Close.
func TestStreamSourceCancelBlockedShard(t *testing.T) {
	base := pipelinetest.CountGoroutines()
	pr, pw := io.Pipe()
	defer pw.Close()
	ctx, cancel := context.WithCancel(context.Background())
	src := NewStreamSource(ctx, []io.Reader{pr}, []string{"stdin"}, StreamSourceOptions{Options: pipeline.Options{Workers: 2}})
	cancel()
	closed := make(chan struct{})
	go func() { src.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(testwait.Scale(2 * time.Second)):
		pw.CloseWithError(errors.New("test gives up")) // unblock it for cleanup
		<-closed
		t.Fatal("Close did not return after cancel while the shard blocks")
	}
	pipelinetest.WaitGoroutines(t, base)
}

// slowReader returns a few bytes per Read, with a pause.
type slowReader struct{ b []byte }

func (s *slowReader) Read(p []byte) (int, error) {
	if len(s.b) == 0 {
		return 0, io.EOF
	}
	time.Sleep(time.Millisecond)
	n := copy(p[:min(len(p), 1000)], s.b)
	s.b = s.b[n:]
	return n, nil
}
