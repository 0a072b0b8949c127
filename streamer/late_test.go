package streamer

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/testwait"
)

// With LateData the non-zero chunks of the page images come after every
// other frame, their FILE-END and zero chunks in place; the stream reads
// back whole (plain and sealed, one shard and two), and the index says
// where every late chunk landed.
func TestCaptureLateData(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	files := lanesCorpus() // pages-1.img and pages-2.img end in zero chunks
	files["inventory.img"] = pipelinetest.SmallData(900, 7)
	names := slices.Sorted(maps.Keys(files))
	k := pipelinetest.Key(t, 3)
	inMemory := lateInMemory
	defer func() { lateInMemory = inMemory }()
	for _, shards := range []int{1, 2} {
		for _, seal := range []*crypt.Session{nil, pipelinetest.Session(t, k)} {
			// Sealed, the late frames outgrow a memfd of 1 MiB: the rest
			// goes to a file.
			spill := seal != nil
			t.Run(fmt.Sprintf("%d-sealed-%v", shards, seal != nil), func(t *testing.T) {
				lateInMemory = inMemory
				if spill {
					lateInMemory = func() int64 { return 1 << 20 }
				}
				live := newLiveShards(ctx, shards, keyIf(seal, k))
				defer live.src.Close()
				so, err := NewStreamOutputAs(live.ws, pipeline.Format{Seal: seal, LateData: true})
				if err != nil {
					t.Fatal(err)
				}
				c, err := NewCapture(ctx, so, pipeline.Options{ChunkSize: 128 << 10, Workers: 2, Codec: pipelinetest.MustSpec(t, "lz4"), LateData: true})
				if err != nil {
					t.Fatal(err)
				}
				for _, n := range names {
					if _, err := c.WriteFile(n, bytes.NewReader(files[n]), false); err != nil {
						t.Fatal(err)
					}
				}
				m, err := c.Close(ctx, manifest.Manifest{})
				live.close(err)
				if err != nil {
					t.Fatalf("%v (the reader: %v)", err, live.src.Err())
				}
				pipelinetest.CheckSource(t, ctx, "pages last", live.src, files)
				if shards == 1 {
					checkFramePositions(t, m, live.bufs)
				}
				for s, b := range live.bufs {
					checkLateData(t, fmt.Sprintf("shard %d", s), b.Bytes(), k)
				}
				if spilled := len(c.late.files) > 1; spilled != spill {
					t.Fatalf("late frames in %d files, want a spill %v", len(c.late.files), spill)
				}
			})
		}
	}
}

// checkLateData reads a shard's frames in order: every non-zero chunk of
// a page image must come after every FILE-END, and some must (the test
// holds something back); every other DATA frame before them.
func checkLateData(t *testing.T, what string, b []byte, k *crypt.Key) {
	t.Helper()
	rd, err := manifest.NewReader(bytes.NewReader(b), what)
	if err != nil {
		t.Fatal(err)
	}
	if rd.Header().Encryption != nil {
		s, err := pipeline.OpenSession(k, rd.Header().Encryption)
		if err != nil {
			t.Fatal(err)
		}
		pipeline.CheckEnd(rd, s)
	}
	ends, late, zeros := 0, 0, 0
	for {
		fr, err := rd.Next(nil)
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		switch {
		case fr.Type == manifest.FrameFileEnd:
			if late > 0 {
				t.Fatalf("%s: FILE-END of %s after a late chunk", what, fr.Name)
			}
			ends++
		case fr.Type != manifest.FrameData:
		case pagesImage.MatchString(fr.Name) && codec.ID(fr.Codec) != codec.Zero:
			late++
		case late > 0:
			t.Fatalf("%s: chunk of %s at %d after a late chunk", what, fr.Name, fr.Offset)
		case pagesImage.MatchString(fr.Name):
			zeros++
		}
	}
	if late == 0 || zeros == 0 || ends == 0 {
		t.Fatalf("%s: %d late chunks, %d zero chunks of page images in place, %d FILE-END frames: the test shows nothing", what, late, zeros, ends)
	}
}

// Only an output written as format 5 may carry data after a FILE-END: a
// capture holding pages back into any other is refused before it writes.
func TestCaptureLateDataNeedsFormat5(t *testing.T) {
	ctx := context.Background()
	loc := mem.New("loc")
	dedup, err := NewDedupOutput(ctx, store.Sub(loc, "ckpt"), loc, 1<<20, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer dedup.Abort(ctx)
	stream, err := NewStreamOutput([]io.Writer{io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	for what, out := range map[string]Output{"a deduplicated checkpoint": dedup, "a stream of format 3": stream} {
		if _, err := NewCapture(ctx, out, pipeline.Options{LateData: true}); err == nil {
			t.Errorf("a capture holding pages back into %s was started", what)
		}
	}
}
