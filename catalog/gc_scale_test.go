package catalog

// A fleet's chunk store, built directly through the real writers (packs by
// streamer.PackWriter, index objects by chunkstore.WriteIndex, manifests
// by pipeline.MarshalManifest) instead of by captures, so that a million
// chunks take minutes rather than hours: each chunk is 8 bytes (its
// number), so that the packs stay small on disk while the index, the
// manifests and gc's bookkeeping have a million entries.

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"runtime"
	"runtime/metrics"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/store/miniotest"
	"github.com/gpucr/gpucr-stream/store/s3"
	"github.com/gpucr/gpucr-stream/streamer"
)

var (
	fleetChunks = flag.Int("fleet-chunks", 1_000_000, "chunks in BenchmarkGCFleet's location")
	fleetCkpts  = flag.Int("fleet-checkpoints", 320, "checkpoints in BenchmarkGCFleet's location")
)

// fleet is the shape of a location: ckpts checkpoints, each adding perCkpt
// chunks of its own (its index object, its packs of packBytes) and
// referencing, besides them, three in ten of the chunks its predecessor
// added (every chunk whose number ends in 0, 1 or 2).
type fleet struct {
	ckpts, perCkpt int
	packBytes      int64
}

// chunkFrame is the frame size of a chunk: the header and 8 bytes.
const chunkFrame = manifest.FrameSize + 8

// fleetOf is a fleet of about n chunks in ckpts checkpoints, with packs
// of 250 chunks (a 256 MiB pack holds about 800 of the ~320 KiB average
// chunk; a capture's lanes leave several packs part full).
func fleetOf(n, ckpts int) fleet {
	return fleet{ckpts: ckpts, perCkpt: max(1, n/ckpts), packBytes: 250 * chunkFrame}
}

// removed says checkpoint i was removed: the oldest tenth (their chunks
// are garbage: their packs go), and every fourth after them (three in ten
// of their chunks stay live: their packs are repacked).
func (f fleet) removed(i int) bool { return i < f.ckpts/10 || i%4 == 0 }

// shared says chunk j of a checkpoint is referenced by the next one.
func shared(j int) bool { return j%10 < 3 }

// live says chunk j of checkpoint i is referenced by a checkpoint kept.
func (f fleet) live(i, j int) bool {
	return !f.removed(i) || (i+1 < f.ckpts && !f.removed(i+1) && shared(j))
}

// chunkOf is chunk j of checkpoint i: its raw bytes and frame header.
func (f fleet) chunkOf(i, j int) ([]byte, manifest.FrameHeader) {
	raw := binary.LittleEndian.AppendUint64(nil, uint64(i*f.perCkpt+j))
	return raw, manifest.FrameHeader{Type: manifest.FrameData, Codec: uint8(codec.None), RawLen: uint32(len(raw)),
		StoredLen: uint32(len(raw)), Checksum: codec.Checksum(raw), Hash: codec.ContentHash(raw)}
}

// built is where the fleet's chunks went: per checkpoint, per chunk.
type built struct {
	at    [][]chunkstore.Ref
	sizes map[chunkstore.PackID]int64
}

// build writes the fleet into loc: each checkpoint's packs and index
// object (workers at once), then the manifests of those not removed.
func (f fleet) build(ctx context.Context, loc store.Store) (*built, error) {
	bl := &built{at: make([][]chunkstore.Ref, f.ckpts), sizes: map[chunkstore.PackID]int64{}}
	var mu sync.Mutex
	var first error
	fail := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		if first == nil {
			first = err
		}
	}
	var wg sync.WaitGroup
	next := make(chan int)
	for range 4 {
		wg.Go(func() {
			for i := range next {
				if err := f.buildPacks(ctx, loc, i, bl, &mu); err != nil {
					fail(fmt.Errorf("checkpoint %d: %w", i, err))
				}
			}
		})
	}
	for i := range f.ckpts {
		next <- i
	}
	close(next)
	wg.Wait()
	if first != nil {
		return nil, first
	}
	next = make(chan int)
	for range 4 {
		wg.Go(func() {
			for i := range next {
				if err := f.commit(ctx, loc, i, bl); err != nil {
					fail(fmt.Errorf("manifest %d: %w", i, err))
				}
			}
		})
	}
	for i := range f.ckpts {
		if !f.removed(i) {
			next <- i
		}
	}
	close(next)
	wg.Wait()
	return bl, first
}

func (f fleet) buildPacks(ctx context.Context, loc store.Store, i int, bl *built, mu *sync.Mutex) error {
	w, err := streamer.NewPackWriter(loc, f.packBytes)
	if err != nil {
		return err
	}
	at := make([]chunkstore.Ref, f.perCkpt)
	chunks := make([]chunkstore.Chunk, f.perCkpt)
	for j := range at {
		raw, fh := f.chunkOf(i, j)
		pack, pos, err := w.Write(ctx, &fh, raw)
		if err != nil {
			_ = w.Abort(ctx)
			return err
		}
		at[j] = chunkstore.Ref{Pack: pack, Pos: pos, RawLen: fh.RawLen, Stored: fh.StoredLen, Codec: fh.Codec, Checksum: fh.Checksum}
		chunks[j] = chunkstore.Chunk{ID: fh.Hash, Ref: at[j]}
	}
	packs, err := w.Commit(ctx)
	if err != nil {
		_ = w.Abort(ctx)
		return err
	}
	if _, err := chunkstore.WriteIndex(ctx, loc, packs, chunks); err != nil {
		return err
	}
	mu.Lock()
	defer mu.Unlock()
	bl.at[i] = at
	for _, p := range packs {
		bl.sizes[p.ID] = p.Size
	}
	return nil
}

// image is checkpoint i's one file, pages-1.img: its own chunks, then its
// predecessor's that it shares.
func (f fleet) image(i int) (raw []byte, refs [][2]int) {
	for j := range f.perCkpt {
		refs = append(refs, [2]int{i, j})
	}
	if i > 0 {
		for j := range f.perCkpt {
			if shared(j) {
				refs = append(refs, [2]int{i - 1, j})
			}
		}
	}
	for _, r := range refs {
		b, _ := f.chunkOf(r[0], r[1])
		raw = append(raw, b...)
	}
	return raw, refs
}

// commit writes checkpoint i's manifest, as a capture's commit would.
func (f fleet) commit(ctx context.Context, loc store.Store, i int, bl *built) error {
	_, refs := f.image(i)
	m := &manifest.Manifest{ID: fmt.Sprintf("ckpt-%04d", i), Created: time.Now().UTC(), Tool: "BenchmarkGCFleet",
		Codec: codec.None.String(), ChunkSize: 8, SharedChunks: true}
	file := manifest.File{Name: "pages-1.img"}
	seg := map[chunkstore.PackID]int{}
	var digested []byte
	for _, r := range refs {
		_, fh := f.chunkOf(r[0], r[1])
		ref := bl.at[r[0]][r[1]]
		s, ok := seg[ref.Pack]
		if !ok {
			s = len(m.Segments)
			seg[ref.Pack] = s
			m.Segments = append(m.Segments, manifest.Segment{Name: ref.Pack.Name(), Size: bl.sizes[ref.Pack]})
		}
		file.Chunks = append(file.Chunks, manifest.Chunk{Offset: file.Size, RawLen: fh.RawLen, Stored: fh.StoredLen,
			Codec: fh.Codec, Checksum: fh.Checksum, Hash: fh.Hash, Segment: s, Pos: ref.Pos})
		file.Size += int64(fh.RawLen)
		digested = append(digested, fh.Hash[:]...)
		m.Stats.Add(codec.None.String(), int64(fh.RawLen), int64(fh.StoredLen))
		if r[0] == i {
			m.Stats.NewChunks++
			m.Stats.NewStoredBytes += int64(fh.StoredLen)
		}
	}
	file.Digest = pipeline.FileDigest(digested, file.Size)
	m.Files = []manifest.File{file}
	doc, err := pipeline.MarshalManifest(m, nil)
	if err != nil {
		return err
	}
	w, err := store.Sub(loc, m.ID).Create(ctx, manifest.ManifestName)
	if err != nil {
		return err
	}
	if _, err := w.Write(doc); err != nil {
		_ = w.Abort(ctx)
		return err
	}
	return w.CommitNew(ctx)
}

// want is what gc of the fleet must do: the packs it removes (no chunk
// live), repacks (live frames fill less than half) and the chunks left.
func (f fleet) want(bl *built) (removed, repacked, chunks int) {
	liveBytes := map[chunkstore.PackID]int64{}
	for i, at := range bl.at {
		for j, r := range at {
			if _, ok := liveBytes[r.Pack]; !ok {
				liveBytes[r.Pack] = 0
			}
			if f.live(i, j) {
				liveBytes[r.Pack] += chunkFrame
				chunks++
			}
		}
	}
	for p, n := range liveBytes {
		switch {
		case n == 0:
			removed++
		case float64(n) < RepackShare*float64(bl.sizes[p]):
			repacked++
		}
	}
	return removed, repacked, chunks
}

// TestGCFleet: gc of a fleet's location (a small one) removes the packs of
// the checkpoints removed, repacks those mostly garbage, leaves an index of
// the live chunks alone, and every checkpoint kept restores whole.
func TestGCFleet(t *testing.T) {
	f := fleet{ckpts: 24, perCkpt: 200, packBytes: 50 * chunkFrame}
	for kind, loc := range locations(t) {
		t.Run(kind, func(t *testing.T) {
			ctx := context.Background()
			bl, err := f.build(ctx, loc)
			if err != nil {
				t.Fatal(err)
			}
			removed, repacked, chunks := f.want(bl)
			if removed == 0 || repacked == 0 {
				t.Fatalf("the fleet leaves gc nothing to do: %d packs to remove, %d to repack", removed, repacked)
			}
			res, err := GCChunks(ctx, loc, 0, false, 0)
			if err != nil {
				t.Fatal(err)
			}
			if res.Removed != removed || res.Repacked != repacked || len(res.Lost) != 0 || res.Skipped != "" || res.IndexObjects != f.ckpts {
				t.Fatalf("gc: %+v; want %d packs removed, %d repacked, %d index objects replaced", res, removed, repacked, f.ckpts)
			}
			tbl, err := chunkstore.Load(ctx, loc)
			if err != nil || tbl.Len() != chunks {
				t.Fatalf("index after gc: %d chunks, want %d (%v)", tbl.Len(), chunks, err)
			}
			for i := range f.ckpts {
				if !f.removed(i) {
					raw, _ := f.image(i)
					verifyIn(t, store.Sub(loc, fmt.Sprintf("ckpt-%04d", i)), map[string][]byte{"pages-1.img": raw})
				}
			}
			if res, err := GCChunks(ctx, loc, 0, false, 0); err != nil || res.Removed+res.Repacked != 0 {
				t.Fatalf("second gc: %+v, %v", res, err)
			}
		})
	}
}

// buildFor builds the fleet in loc for a benchmark and says what gc must
// remove and repack; what it knows of the fleet is garbage once it returns.
func (f fleet) buildFor(b *testing.B, loc store.Store) (removed, repacked int) {
	if c, ok := loc.(io.Closer); ok {
		defer c.Close()
	}
	start := time.Now()
	bl, err := f.build(context.Background(), loc)
	if err != nil {
		b.Fatal(err)
	}
	removed, repacked, chunks := f.want(bl)
	b.Logf("built %d checkpoints of %d new chunks each (%d chunks, %d packs) in %s; gc must remove %d packs, repack %d, keep %d chunks",
		f.ckpts, f.perCkpt, f.ckpts*f.perCkpt, len(bl.sizes), time.Since(start).Round(time.Millisecond), removed, repacked, chunks)
	return removed, repacked
}

// heapWatch samples the Go heap while gc runs: the bytes of heap objects
// (live and not yet collected: what the process must hold) and the live
// heap the last collection marked, each at its highest.
type heapWatch struct {
	stop       chan struct{}
	done       sync.WaitGroup
	heap, live uint64
	// before is the live heap when it starts: what the benchmark holds.
	before uint64
}

func watchHeap() *heapWatch {
	runtime.GC()
	w := &heapWatch{stop: make(chan struct{})}
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}, {Name: "/gc/heap/live:bytes"}}
	metrics.Read(s)
	w.before = s[1].Value.Uint64()
	w.done.Go(func() {
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			metrics.Read(s)
			w.heap = max(w.heap, s[0].Value.Uint64())
			w.live = max(w.live, s[1].Value.Uint64())
			select {
			case <-w.stop:
				return
			case <-tick.C:
			}
		}
	})
	return w
}

// end stops sampling and returns the peaks and the live heap before, in
// MiB.
func (w *heapWatch) end() (heap, live, before float64) {
	close(w.stop)
	w.done.Wait()
	return float64(w.heap) / (1 << 20), float64(w.live) / (1 << 20), float64(w.before) / (1 << 20)
}

// BenchmarkGCFleet is gc of a location of a million chunks (-fleet-chunks)
// in 320 checkpoints (-fleet-checkpoints), a tenth of them the oldest removed and a fourth of
// the rest: the time and the peaks of the Go heap (sampled every
// millisecond) while it runs. Run it with -benchtime 1x: each round builds
// the location again, untimed.
func BenchmarkGCFleet(b *testing.B) {
	f := fleetOf(*fleetChunks, *fleetCkpts)
	// Each returns how to open the location; gc opens it afresh, as a
	// gc process would, so that it is not charged for what the store
	// handle the build wrote through keeps (an S3 store's part buffers).
	stores := map[string]func(b *testing.B) func() store.Store{
		"dir": func(b *testing.B) func() store.Store {
			path := b.TempDir()
			return func() store.Store { return dir.New(path) }
		},
		"s3": func(b *testing.B) func() store.Store {
			srv := miniotest.Start(b)
			srv.MakeBucket(b, "dedup")
			return func() store.Store {
				st, err := s3.New(context.Background(), s3.Config{Endpoint: srv.Endpoint(), Bucket: "dedup", Prefix: "fleet",
					AccessKey: srv.AccessKey(), SecretKey: srv.SecretKey(), PartSize: 16 << 20, Parallel: 4, MaxRetries: 3})
				if err != nil {
					b.Fatal(err)
				}
				return st
			}
		},
	}
	for _, kind := range []string{"dir", "s3"} {
		b.Run(kind, func(b *testing.B) {
			ctx := context.Background()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				open := stores[kind](b)
				removed, repacked := f.buildFor(b, open())
				loc := open()
				w := watchHeap()
				b.StartTimer()
				start := time.Now()
				res, err := GCChunks(ctx, loc, 0, false, 0)
				took := time.Since(start)
				b.StopTimer()
				heap, live, before := w.end()
				if c, ok := loc.(io.Closer); ok {
					c.Close()
				}
				if err != nil || res.Removed != removed || res.Repacked != repacked || len(res.Lost) != 0 {
					b.Fatalf("gc: %+v, %v; want %d packs removed, %d repacked", res, err, removed, repacked)
				}
				b.Logf("gc in %s: %d packs, %d removed, %d repacked into %d; peak heap %.1f MiB, peak live heap %.1f MiB (%.1f MiB before gc)",
					took.Round(time.Millisecond), res.Packs, res.Removed, res.Repacked, res.RepackedInto, heap, live, before)
				b.ReportMetric(heap, "peak-heap-MiB")
				b.ReportMetric(live, "peak-live-MiB")
			}
		})
	}
}

// TestMarkFramesMemory: what gc keeps of the manifests' references to
// decide what to sweep and repack is a bit per chunk of the index beside
// the table, not a record per frame (which took as much again as the
// table: 40 MiB for a million chunks).
func TestMarkFramesMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a location of 200,000 chunks")
	}
	ctx := context.Background()
	f := fleet{ckpts: 64, perCkpt: 3125, packBytes: 250 * chunkFrame}
	loc := mem.New("fleet")
	if _, err := f.build(ctx, loc); err != nil {
		t.Fatal(err)
	}
	objs, err := loc.List(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	present, err := chunkstore.Packs(ctx, loc)
	if err != nil {
		t.Fatal(err)
	}
	tbl, err := chunkstore.Load(ctx, loc)
	if err != nil {
		t.Fatal(err)
	}
	// Twice: a pool's objects outlive one collection.
	var before, after runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&before)
	marks, err := markFrames(ctx, loc, objs, tbl, present, &ChunkGCResult{})
	if err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&after)
	n := tbl.Len()
	per := (float64(after.HeapAlloc) - float64(before.HeapAlloc)) / float64(n)
	t.Logf("%.2f bytes a chunk kept of the marks (%d chunks, %d packs live)", per, n, len(marks.Live()))
	// A bit a chunk, and the packs': 4 leaves room for the runtime's
	// own; a record per live frame was about 22.
	if per > 4 {
		t.Errorf("the marks keep %.2f bytes a chunk, want at most 4", per)
	}
	runtime.KeepAlive(marks)
	runtime.KeepAlive(tbl)
	runtime.KeepAlive(loc) // and objs, present: what the marks must not be charged for
	runtime.KeepAlive(objs)
	runtime.KeepAlive(present)
}
