package source

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/streamer"
)

// pagesImage is a CRIU-like pages image: n pages of mixed content (noise,
// text-like, zeros), deterministic in seed.
func pagesImage(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, seed))
	b := make([]byte, n*4096)
	for p := range n {
		page := b[p*4096 : (p+1)*4096]
		switch r.IntN(4) {
		case 0: // zeros
		case 1:
			for i := range page {
				page[i] = "abcdefgh "[r.IntN(9)]
			}
		default:
			for i := 0; i < len(page); i += 8 {
				v := r.Uint64()
				for k := range 8 {
					page[i+k] = byte(v >> (8 * k))
				}
			}
		}
	}
	return b
}

// dedupCapture writes files as a format 4 checkpoint name of loc.
func dedupCapture(t testing.TB, loc store.Store, name string, files map[string][]byte, opts pipeline.Options) *manifest.Manifest {
	t.Helper()
	ctx := context.Background()
	out, err := streamer.NewDedupOutput(ctx, store.Sub(loc, name), loc, 8<<20, nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err := streamer.NewCapture(ctx, out, opts)
	if err != nil {
		t.Fatal(err)
	}
	for n, data := range files {
		if _, err := c.WriteFile(n, bytes.NewReader(data), false); err != nil {
			t.Fatal(err)
		}
	}
	m, err := c.Close(ctx, manifest.Manifest{Tool: "test"})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func checkRestore(t testing.TB, loc store.Store, name string, files map[string][]byte, verify bool) {
	t.Helper()
	ctx := context.Background()
	opts := pipeline.Options{VerifyHashes: verify}
	a, err := OpenArchive(ctx, store.Sub(loc, name), opts)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if a.Manifest().Format != manifest.VersionSharedChunks {
		t.Fatalf("format %d, want %d", a.Manifest().Format, manifest.VersionSharedChunks)
	}
	for n, data := range files {
		var buf bytes.Buffer
		if _, err := a.Copy(ctx, n, &buf); err != nil {
			t.Fatalf("copy %s: %v", n, err)
		}
		if !bytes.Equal(buf.Bytes(), data) {
			t.Fatalf("%s: restored %d bytes differ from the %d captured", n, buf.Len(), len(data))
		}
	}
}

func TestDedupRoundTrip(t *testing.T) {
	stores := map[string]store.Store{"mem": mem.New("loc"), "dir": dir.New(t.TempDir())}
	for kind, loc := range stores {
		t.Run(kind, func(t *testing.T) {
			opts := pipeline.Options{ChunkSize: 1 << 20, Workers: 2, Codec: pipelinetest.MustSpec(t, "auto")}
			img := pagesImage(2048, 1) // 8 MiB
			files := map[string][]byte{"pages-1.img": img, "core-1.img": []byte("core"), "empty.img": nil, "zeros.img": make([]byte, 3<<20)}
			m1 := dedupCapture(t, loc, "one", files, opts)
			checkRestore(t, loc, "one", files, true)
			if m1.Stats.NewStoredBytes == 0 || m1.Stats.NewStoredBytes > m1.Stats.StoredBytes {
				t.Fatalf("first checkpoint: %d new of %d stored bytes", m1.Stats.NewStoredBytes, m1.Stats.StoredBytes)
			}

			// Unchanged: nothing new.
			m2 := dedupCapture(t, loc, "two", files, opts)
			checkRestore(t, loc, "two", files, false)
			if m2.Stats.NewStoredBytes != 0 {
				t.Errorf("unchanged second checkpoint added %d bytes (first: %d)", m2.Stats.NewStoredBytes, m1.Stats.NewStoredBytes)
			}

			// A page inserted near the start shifts the rest by a page:
			// content-defined cuts must find the rest again.
			shifted := append(append(append([]byte(nil), img[:8192]...), pagesImage(1, 99)...), img[8192:]...)
			files3 := map[string][]byte{"pages-1.img": shifted}
			m3 := dedupCapture(t, loc, "three", files3, opts)
			checkRestore(t, loc, "three", files3, true)
			share := float64(m3.Stats.NewStoredBytes) / float64(m1.Stats.NewStoredBytes)
			t.Logf("after a page inserted at 8 KiB: %d of %d bytes new (%.1f%%), %d of %d chunks", m3.Stats.NewStoredBytes, m1.Stats.NewStoredBytes, 100*share, m3.Stats.NewChunks, m3.Stats.Chunks)
			if share > 0.25 {
				t.Errorf("a page inserted near the start made %.0f%% of the image new", 100*share)
			}
		})
	}
}

func TestDedupManifestNamesOnlyPacks(t *testing.T) {
	ctx := context.Background()
	loc := mem.New("loc")
	files := map[string][]byte{"pages-1.img": pagesImage(64, 3)}
	dedupCapture(t, loc, "one", files, pipeline.Options{ChunkSize: 1 << 20, Workers: 1, Codec: pipelinetest.MustSpec(t, "none")})
	m, err := ReadManifest(ctx, store.Sub(loc, "one"))
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Segments) == 0 {
		t.Fatal("no packs")
	}
	if _, ok := chunkstore.ParsePackName(m.Segments[0].Name); !ok {
		t.Fatalf("segment %s is not a pack", m.Segments[0].Name)
	}
	m.Segments[0].Name = "one/manifest.json"
	doc, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	w, _ := loc.Create(ctx, "bad/"+manifest.ManifestName)
	w.Write(doc)
	w.Commit(ctx)
	if _, err := OpenArchive(ctx, store.Sub(loc, "bad"), pipeline.Options{}); !errors.Is(err, errdefs.ErrCorrupt) {
		t.Fatalf("a manifest naming a non-pack: %v, want corrupt", err)
	}
}
