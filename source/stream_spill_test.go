package source

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/testwait"
)

// spillFDs counts this process's open files that live (or lived, being
// unlinked) in dir.
func spillFDs(t *testing.T, dir string) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && strings.HasPrefix(target, dir+"/") {
			n++
		}
	}
	return n
}

// A stream spilling far past its budget on several decoders spreads the
// chunks over several spill files (one file's writes serialize on its
// inode lock), each unlinked at once and all closed by Close; what it
// serves, by write and by splice out of those files, is exact.
func TestStreamSpillFiles(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(4)) // spillMax = 4 on any machine
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
	defer cancel()
	const chunk = minSpliceChunk
	files := map[string][]byte{
		"pages-1.img":   pipelinetest.MixedData(12*chunk+1000, 11),
		"pages-2.img":   pipelinetest.MixedData(5*chunk, 12),
		"inventory.img": pipelinetest.SmallData(3000, 1),
	}
	var buf bytes.Buffer
	out, err := streamer.NewStreamOutput([]io.Writer{&buf})
	if err != nil {
		t.Fatal(err)
	}
	captureFiles(t, ctx, out, pipeline.Options{ChunkSize: chunk, Workers: 2, Codec: pipelinetest.MustSpec(t, "lz4")}, files)
	dir := t.TempDir()
	src := NewStreamSource(ctx, []io.Reader{&buf}, []string{"buf"},
		StreamSourceOptions{Options: pipeline.Options{Workers: 4, MemoryLimit: 2 * chunk}, SpillDir: dir})
	defer src.Close() // a second Close does nothing (TestStreamSourceCloseTwice)
	if err := src.Wait(ctx); err != nil {
		t.Fatal(err)
	}

	src.mu.Lock()
	spills := len(src.spill.files)
	used := map[*os.File]int64{} // spilled bytes per file
	for _, f := range src.complete {
		for _, c := range f.chunks {
			if c.fd != nil {
				used[c.fd] += c.n
			}
		}
	}
	src.mu.Unlock()
	if spills != 4 || len(used) != spills {
		t.Fatalf("%d spill files, %d of them holding chunks; want 4, all used", spills, len(used))
	}
	var spilled int64
	for _, n := range used {
		spilled += n
	}
	if spilled < 10*chunk {
		t.Fatalf("%d bytes spilled with a budget of %d: want most of the image", spilled, 2*chunk)
	}
	if ents, err := os.ReadDir(dir); err != nil || len(ents) != 0 {
		t.Fatalf("spill dir holds %d entries (%v): spill files must be unlinked", len(ents), err)
	}
	if n := spillFDs(t, dir); n != spills {
		t.Fatalf("%d open files in the spill dir, want %d", n, spills)
	}

	pipelinetest.CheckSource(t, ctx, "spill", src, files)
	for name, want := range files {
		got, err := copyThroughPipe(ctx, src, name, false, -1)
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%s into a pipe: %d bytes, want %d, equal %v (%v)", name, len(got), len(want), bytes.Equal(got, want), err)
		}
	}

	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
	if n := spillFDs(t, dir); n != 0 {
		t.Fatalf("%d spill files still open after Close", n)
	}
}

// TestStreamSourceCloseTwice: a second Close releases nothing again (it
// would free page buffers twice and count the memory they held twice).
func TestStreamSourceCloseTwice(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	const chunk = minSpliceChunk
	files := map[string][]byte{"pages-1.img": pipelinetest.MixedData(4*chunk, 21), "inventory.img": pipelinetest.SmallData(3000, 2)}
	var buf bytes.Buffer
	out, err := streamer.NewStreamOutput([]io.Writer{&buf})
	if err != nil {
		t.Fatal(err)
	}
	captureFiles(t, ctx, out, pipeline.Options{ChunkSize: chunk, Workers: 2}, files)
	src := NewStreamSource(ctx, []io.Reader{&buf}, []string{"buf"}, StreamSourceOptions{Options: pipeline.Options{Workers: 2}})
	pipelinetest.CheckSource(t, ctx, "held", src, files)
	for i := 0; i < 2; i++ {
		if err := src.Close(); err != nil {
			t.Fatal(err)
		}
		if src.memUsed != 0 || src.metaUsed != 0 || len(src.retired) != 0 {
			t.Fatalf("after Close #%d: %d bytes of chunks and %d of metadata counted, %d buffers retired; want none",
				i+1, src.memUsed, src.metaUsed, len(src.retired))
		}
	}
}
