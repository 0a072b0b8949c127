package streamer

import (
	"bytes"
	"context"
	"iter"
	"math/rand/v2"
	"sync/atomic"
	"testing"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/mem"
)

// cutsOf yields cuts as they are.
func cutsOf(cuts ...Cut) iter.Seq2[Cut, error] {
	return func(yield func(Cut, error) bool) {
		for _, c := range cuts {
			if !yield(c, nil) {
				return
			}
		}
	}
}

// bytesCut is a cut of b, visited into seen.
func bytesCut(b []byte, seen *atomic.Int64) Cut {
	return Cut{Len: len(b), Fill: func(d []byte) error { copy(d, b); return nil }, Visit: func(d []byte) {
		if bytes.Equal(d, b) {
			seen.Add(int64(len(d)))
		}
	}}
}

// TestWriteCuts: a file written by its cuts into a deduplicated
// checkpoint: a cut of bytes is a chunk as it comes, visited on a worker
// before WriteCuts returns; a cut naming a chunk the location holds is
// referenced, never read; the checkpoint reads back whole. A cut naming a
// chunk the location does not hold, or one over the chunk size, fails
// the capture.
func TestWriteCuts(t *testing.T) {
	ctx := context.Background()
	loc := mem.New("loc")
	r := rand.New(rand.NewPCG(1, 2))
	part := func() []byte {
		b := make([]byte, 64<<10)
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		return b
	}
	a, b, c, d := part(), part(), part(), part()
	none, _ := codec.ParseSpec("none")
	opts := pipeline.Options{ChunkSize: 128 << 10, Workers: 2, Codec: none}
	capture := func(name string, cuts ...Cut) (*manifest.Manifest, error) {
		out, err := NewDedupOutput(ctx, store.Sub(loc, name), loc, 1<<20, nil)
		if err != nil {
			t.Fatal(err)
		}
		cp, err := NewCapture(ctx, out, opts)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cp.WriteCuts("f", cutsOf(cuts...)); err != nil {
			cp.Abort(err)
			_, _ = cp.Close(ctx, manifest.Manifest{})
			return nil, err
		}
		return cp.Close(ctx, manifest.Manifest{})
	}
	var seen atomic.Int64
	one, err := capture("one", bytesCut(a, &seen), bytesCut(b, &seen), bytesCut(c, &seen))
	if err != nil || seen.Load() != 3<<16 || len(one.Files) != 1 || len(one.Files[0].Chunks) != 3 {
		t.Fatalf("first: %v, %d bytes visited, %+v", err, seen.Load(), one)
	}
	ref := func(i int) Cut {
		ch := one.Files[0].Chunks[i]
		return Cut{Len: int(ch.RawLen), Hash: ch.Hash, CRC: ch.Checksum}
	}
	seen.Store(0)
	two, err := capture("two", ref(0), bytesCut(d, &seen), ref(2))
	if err != nil || seen.Load() != 1<<16 || two.Stats.NewChunks != 1 {
		t.Fatalf("second: %v, %d bytes visited, %+v", err, seen.Load(), two.Stats)
	}
	src, err := source.OpenArchive(ctx, store.Sub(loc, "two"), opts)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ra, size, err := src.ReaderAt(ctx, "f")
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	if _, err := ra.ReadAt(got, 0); err != nil || !bytes.Equal(got, bytes.Join([][]byte{a, d, c}, nil)) {
		t.Fatalf("read back: %v, %d bytes", err, size)
	}

	unknown := ref(1)
	unknown.Hash[0] ^= 1
	if _, err := capture("three", unknown); err == nil {
		t.Fatal("a cut naming a chunk the location does not hold was written")
	}
	if _, err := capture("four", bytesCut(bytes.Join([][]byte{a, b, c}, nil), &seen)); err == nil {
		t.Fatal("a cut over the chunk size was written")
	}
}
