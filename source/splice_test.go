package source

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/testwait"
	"golang.org/x/sys/unix"
)

// Archives served into real pipes go by vmsplice: the reader must see
// exactly the files, also when it reads slowly and the pipe is small (so
// that the pipe holds our pages while later chunks are decoded).
func TestArchiveCopyIntoPipe(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
	defer cancel()
	for _, spec := range []string{"none", "lz4", "auto"} {
		t.Run(spec, func(t *testing.T) {
			ac := newArchiveCorpus(t, spec)
			a, err := OpenArchive(ctx, ac.store, pipeline.Options{Workers: 2})
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			for name, want := range ac.files {
				for _, nonblock := range []bool{false, true} {
					got, err := copyThroughPipe(ctx, a, name, nonblock, -1)
					if err != nil {
						t.Fatalf("%s (nonblock %v): %v", name, nonblock, err)
					}
					if !bytes.Equal(got, want) {
						t.Fatalf("%s (nonblock %v): %d bytes read, want %d; equal=%v", name, nonblock, len(got), len(want), bytes.Equal(got, want))
					}
				}
			}
		})
	}
}

// Streams (serve, receive) keep decoded chunks in page buffers and splice
// them too: the bytes must be exact whether a chunk stays in memory or is
// spilled to disk past the memory limit, and a file may be copied twice.
func TestStreamCopyIntoPipe(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
	defer cancel()
	const chunk = minSpliceChunk
	pages := splicePages(7)
	files := map[string][]byte{"inventory.img": pipelinetest.SmallData(3000, 0), "pages-1.img": pages, "core-1.img": pipelinetest.SmallData(5000, 3)}
	for _, tc := range []struct {
		spec  string
		limit int64 // memory limit of the source: below the image, chunks spill
	}{{"none", 1 << 30}, {"lz4", 1 << 30}, {"auto", 1 << 30}, {"auto", 2 * chunk}} {
		t.Run(fmt.Sprintf("%s-limit%d", tc.spec, tc.limit), func(t *testing.T) {
			var buf bytes.Buffer
			out, err := streamer.NewStreamOutput([]io.Writer{&buf})
			if err != nil {
				t.Fatal(err)
			}
			captureFiles(t, ctx, out, pipeline.Options{ChunkSize: chunk, Workers: 2, Codec: pipelinetest.MustSpec(t, tc.spec)}, files)
			src := NewStreamSource(ctx, []io.Reader{&buf}, []string{"buf"}, StreamSourceOptions{Options: pipeline.Options{Workers: 2, MemoryLimit: tc.limit}})
			defer src.Close()
			if err := src.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			var paged, spilled int
			for _, c := range src.complete["pages-1.img"].chunks {
				if c.n < minSpliceChunk {
					continue // the tail: in the heap or spilled
				}
				if c.page != nil {
					paged++
				}
				if c.fd != nil {
					spilled++
				}
			}
			// 4 whole non-zero chunks (and a tail too small for a mapping).
			if paged+spilled != 4 || (tc.limit < int64(len(pages)) && spilled == 0) {
				t.Fatalf("pages-1.img: %d chunks in page buffers, %d spilled", paged, spilled)
			}
			for name, want := range files {
				for _, nonblock := range []bool{false, true, false} {
					got, err := copyThroughPipe(ctx, src, name, nonblock, -1)
					if err != nil {
						t.Fatalf("%s (nonblock %v): %v", name, nonblock, err)
					}
					if !bytes.Equal(got, want) {
						t.Fatalf("%s (nonblock %v): %d bytes read, want %d, not equal", name, nonblock, len(got), len(want))
					}
				}
			}
		})
	}
}

// splicePages is a pages image of chunks of minSpliceChunk bytes: text,
// random (stored raw), zero, then model-like weights and a short tail.
func splicePages(seed uint64) []byte {
	const chunk = minSpliceChunk
	pages := make([]byte, 5*chunk+1000)
	r := pipelinetest.NewRand(seed)
	pipelinetest.FillText(pages[:chunk], r)
	pipelinetest.FillRandom(pages[chunk:2*chunk], r)
	// chunk 2 stays zero
	pipelinetest.FillBF16(pages[3*chunk:], r)
	return pages
}

// A reader that goes away leaves Copy with an error, not a hang, and
// nothing leaked.
func TestArchiveCopyIntoClosedPipe(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	ac := newArchiveCorpus(t, "none")
	a, err := OpenArchive(ctx, ac.store, pipeline.Options{Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	base := pipelinetest.CountGoroutines()
	if _, err := copyThroughPipe(ctx, a, "pages-1.img", false, 1000); !errors.Is(err, unix.EPIPE) {
		t.Fatalf("Copy into a pipe whose reader left = %v, want EPIPE", err)
	}
	if len(a.tokens) != 0 {
		t.Fatalf("%d tokens leaked", len(a.tokens))
	}
	pipelinetest.WaitGoroutines(t, base)
}

// copyThroughPipe copies name into a 64 KiB pipe read slowly; with limit
// >= 0 the reader stops after that many bytes and closes its end.
func copyThroughPipe(ctx context.Context, a Source, name string, nonblock bool, limit int) ([]byte, error) {
	return copyOmittingThroughPipe(ctx, a, name, nonblock, limit, nil)
}

// copyOmittingThroughPipe is copyThroughPipe through an Omit of omit
// (none if nil).
func copyOmittingThroughPipe(ctx context.Context, a Source, name string, nonblock bool, limit int, omit []Span) ([]byte, error) {
	r, w, err := os.Pipe() // os.Pipe's ends are non-blocking and pollable
	if err != nil {
		return nil, err
	}
	if _, err := unix.FcntlInt(w.Fd(), unix.F_SETPIPE_SZ, 64<<10); err != nil {
		return nil, err
	}
	if nonblock {
		// Fd switched the file to blocking mode; a File made from a
		// non-blocking descriptor is pollable again.
		fd, err := unix.Dup(int(w.Fd()))
		if err != nil {
			return nil, err
		}
		w.Close()
		if err := unix.SetNonblock(fd, true); err != nil {
			return nil, err
		}
		w = os.NewFile(uintptr(fd), "pipe")
	}
	if newChunkWriter(w).pipe == nil {
		return nil, errors.New("a pipe is not written by vmsplice")
	}
	type result struct {
		b   []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		var got bytes.Buffer
		buf := make([]byte, 4096)
		for limit < 0 || got.Len() < limit {
			n, err := r.Read(buf)
			got.Write(buf[:n])
			if err == io.EOF {
				break
			}
			if err != nil {
				done <- result{nil, err}
				return
			}
		}
		r.Close()
		done <- result{got.Bytes(), nil}
	}()
	var to io.Writer = w
	if omit != nil {
		if to, err = NewOmit(w, omit); err != nil {
			return nil, err
		}
	}
	_, err = a.Copy(ctx, name, to)
	w.Close()
	res := <-done
	if err != nil {
		return nil, err
	}
	return res.b, res.err
}
