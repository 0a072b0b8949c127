package catalog

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/store/miniotest"
	"github.com/gpucr/gpucr-stream/store/s3"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/testwait"
)

// noise is n incompressible bytes, deterministic in seed.
func noise(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, 7))
	b := make([]byte, n)
	for i := 0; i < n; i += 8 {
		v := r.Uint64()
		for k := 0; k < 8 && i+k < n; k++ {
			b[i+k] = byte(v >> (8 * k))
		}
	}
	return b
}

// dedupIn captures files as the deduplicated checkpoint name of loc.
func dedupIn(ctx context.Context, loc store.Store, name string, files map[string][]byte) (*manifest.Manifest, error) {
	return dedupKeyed(ctx, loc, name, files, nil)
}

// dedupKeyed is dedupIn encrypted under key, when not nil.
func dedupKeyed(ctx context.Context, loc store.Store, name string, files map[string][]byte, key *crypt.Key) (*manifest.Manifest, error) {
	return dedupOpened(ctx, loc, name, files, key, nil)
}

// dedupOpened is dedupKeyed calling opened, when not nil, once the capture
// holds its lock of loc (and has loaded loc's index, unless it saw a gc's
// lock there), before it writes anything.
func dedupOpened(ctx context.Context, loc store.Store, name string, files map[string][]byte, key *crypt.Key, opened func()) (*manifest.Manifest, error) {
	f, err := pipeline.Options{Key: key}.NewFormat()
	if err != nil {
		return nil, err
	}
	out, err := streamer.NewDedupOutput(ctx, store.Sub(loc, name), loc, 1<<20, f.Seal)
	if err != nil {
		return nil, err
	}
	if opened != nil {
		opened()
	}
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: 256 << 10, Workers: 2})
	if err != nil {
		return nil, err
	}
	for n, b := range files {
		if _, err := c.WriteFile(n, bytes.NewReader(b), false); err != nil {
			c.Abort(err)
			break
		}
	}
	return c.Close(ctx, manifest.Manifest{})
}

// verifyIn restores every file of a checkpoint and verifies it whole.
func verifyIn(t *testing.T, ckpt store.Store, want map[string][]byte) {
	t.Helper()
	verifyKeyed(t, ckpt, want, nil)
}

// verifyKeyed is verifyIn with key.
func verifyKeyed(t *testing.T, ckpt store.Store, want map[string][]byte, key *crypt.Key) {
	t.Helper()
	ctx := context.Background()
	a, err := source.OpenArchive(ctx, ckpt, pipeline.Options{VerifyHashes: true, Key: key})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if _, err := source.VerifyArchive(ctx, a); err != nil {
		t.Fatalf("verify %s: %v", ckpt, err)
	}
	for n, b := range want {
		var got bytes.Buffer
		if _, err := a.Copy(ctx, n, &got); err != nil || !bytes.Equal(got.Bytes(), b) {
			t.Fatalf("%s of %s: %v", n, ckpt, err)
		}
	}
}

// locations are a location of each store: memory, a directory, and an S3
// prefix on MinIO.
func locations(t *testing.T) map[string]store.Store {
	return map[string]store.Store{"mem": mem.New("loc"), "dir": dir.New(t.TempDir()), "s3": s3At(t, minio(t), "loc")}
}

// minio starts a MinIO server with the bucket "dedup".
func minio(t *testing.T) *miniotest.Server {
	srv := miniotest.Start(t)
	srv.MakeBucket(t, "dedup")
	return srv
}

// s3At is the S3 store of prefix in the bucket "dedup".
func s3At(t *testing.T, srv *miniotest.Server, prefix string) *s3.Store {
	t.Helper()
	st, err := s3.New(context.Background(), s3.Config{Endpoint: srv.Endpoint(), Bucket: "dedup", Prefix: prefix,
		AccessKey: srv.AccessKey(), SecretKey: srv.SecretKey(), PartSize: 5 << 20, Parallel: 3, MaxRetries: 3})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// TestDedupS3Parent: a checkpoint opened at its own S3 prefix finds its
// location's chunk store one prefix up, to write and to read.
func TestDedupS3Parent(t *testing.T) {
	ctx := context.Background()
	srv := minio(t)
	files := map[string][]byte{"pages-1.img": noise(3<<20, 30)}
	for _, name := range []string{"one", "two"} {
		ckpt := s3At(t, srv, "fleet/"+name)
		loc, base, ok := store.Parent(ckpt)
		if !ok || base != name || loc.String() != "s3://dedup/fleet" {
			t.Fatalf("parent of %s: %v %q %v", ckpt, loc, base, ok)
		}
		out, err := streamer.NewDedupOutput(ctx, ckpt, loc, 1<<20, nil)
		if err != nil {
			t.Fatal(err)
		}
		c, err := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: 256 << 10, Workers: 2})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.WriteFile("pages-1.img", bytes.NewReader(files["pages-1.img"]), false); err != nil {
			t.Fatal(err)
		}
		m, err := c.Close(ctx, manifest.Manifest{})
		if err != nil {
			t.Fatal(err)
		}
		if name == "two" && m.Stats.NewStoredBytes != 0 {
			t.Errorf("the second checkpoint added %d bytes", m.Stats.NewStoredBytes)
		}
		verifyIn(t, s3At(t, srv, "fleet/"+name), files)
	}
	es, err := List(ctx, s3At(t, srv, "fleet"), "s3://dedup/fleet")
	if err != nil || len(es) != 2 || !es[1].Dedup || es[1].NewBytes >= es[0].NewBytes/20 {
		t.Fatalf("ls: %+v, %v", es, err)
	}
}

func TestGCChunks(t *testing.T) {
	for kind, loc := range locations(t) {
		t.Run(kind, func(t *testing.T) {
			ctx := context.Background()
			// a's chunks are its own: its packs are garbage once it goes.
			// (Packs a shares with another checkpoint stay whole: repacking
			// them is not done yet.)
			a := map[string][]byte{"pages-1.img": noise(2<<20, 2)}
			b := map[string][]byte{"pages-1.img": noise(2<<20, 3)}
			if _, err := dedupIn(ctx, loc, "a", a); err != nil {
				t.Fatal(err)
			}
			mb, err := dedupIn(ctx, loc, "b", b)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := Remove(ctx, store.Sub(loc, "a"), "a", false); err != nil {
				t.Fatal(err)
			}
			res, err := GC(ctx, loc, "loc", 0, false, 0)
			if err != nil {
				t.Fatal(err)
			}
			if res.Chunks == nil || res.Chunks.Removed == 0 || res.Chunks.Skipped != "" {
				t.Fatalf("gc of the chunk store: %+v", res.Chunks)
			}
			verifyIn(t, store.Sub(loc, "b"), b)
			tbl, err := chunkstore.Load(ctx, loc)
			if err != nil {
				t.Fatal(err)
			}
			if got, want := tbl.Len(), int(mb.Stats.Chunks); got > want {
				t.Errorf("index lists %d chunks after gc, b references %d", got, want)
			}
			// A capture after gc shares what b holds, and finds nothing gone.
			mc, err := dedupIn(ctx, loc, "c", b)
			if err != nil {
				t.Fatal(err)
			}
			if mc.Stats.NewStoredBytes != 0 {
				t.Errorf("c repeats b and added %d bytes", mc.Stats.NewStoredBytes)
			}
			verifyIn(t, store.Sub(loc, "c"), b)
		})
	}
}

// TestGCRacesCapture runs captures that share chunks with checkpoints
// being removed while gc runs in a loop: every checkpoint committed must
// restore whole (gc never takes a pack a capture in flight references).
//
// The race must hold repacks, and on its own it need not: a capture that
// takes its lock while a gc holds the location shares nothing (it loads no
// index), so the removal of the checkpoint before it leaves only packs
// wholly garbage, which gc removes, never repacks. A gc run holds the
// location most of the time, the more so on a slow store, and the wait
// after each removal starts the next capture while one does: in CI, under
// load, a run on MinIO held no repack (before: 460 gc runs, 367 skipped,
// none repacked), and with gc's listings slowed by 30 ms no capture
// shared, and no run held one. So every other capture takes its lock with
// gc held off between two runs, and shares; gc runs again while it writes
// and commits (each run must skip for its lock), and the removal of the
// checkpoint before it makes the gc run that takes the location next
// repack, while the next capture starts beside it, free to meet its lock
// or not. That repack is checked for once the runs after it are done.
func TestGCRacesCapture(t *testing.T) {
	for kind, loc := range locations(t) {
		t.Run(kind, func(t *testing.T) {
			ctx := context.Background()
			base := noise(1<<20, 10)
			// Each image shares its last part with the next: once one goes,
			// its pack of new chunks is mostly garbage, and gc repacks it.
			img := func(i int) map[string][]byte {
				return map[string][]byte{"pages-1.img": slices.Concat(base, noise(512<<10, uint64(100+i)), noise(128<<10, uint64(101+i)))}
			}
			if _, err := dedupIn(ctx, loc, "c0", img(0)); err != nil {
				t.Fatal(err)
			}
			const rounds = 12
			var wg sync.WaitGroup
			stop := make(chan struct{})
			stopGC := sync.OnceFunc(func() { close(stop); wg.Wait() })
			// running is held through each gc run (its lock is released
			// when GCChunks returns): a round that holds it holds gc off.
			// The counts but repacked change under it.
			var running sync.Mutex
			gcRuns, skipped, removed := 0, 0, 0
			var repacked, locked atomic.Int64
			watch := &gcWatch{Store: loc, locked: func() { locked.Add(1) }}
			// resume lets the gc loop run again after a round held it off.
			resume := func() {}
			defer func() {
				resume()
				stopGC()
			}()
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					// The chunk store's part of gc: the rest, at age 0,
					// would take the temporary files of writes in flight.
					// Any pack with garbage is repacked, so that repacks
					// race the captures whenever gc finds no capture's
					// lock.
					running.Lock()
					res, err := GCChunks(ctx, watch, 0, false, 0.99)
					if err == nil {
						gcRuns++
						removed += res.Removed
						repacked.Add(int64(res.Repacked))
						if res.Skipped != "" {
							skipped++
						}
					}
					running.Unlock()
					if err != nil {
						t.Errorf("gc: %v", err)
						return
					}
					time.Sleep(time.Millisecond)
				}
			})
			// counts says what the gc runs did; with running held or
			// the loop stopped.
			counts := func() string {
				return fmt.Sprintf("%d gc runs, %d skipped for a capture's lock, %d packs removed, %d repacked", gcRuns, skipped, removed, repacked.Load())
			}
			// repackAfter, when not empty, is the removal that must have
			// made a gc run repack, repackedBefore the count before it.
			repackAfter, repackedBefore := "", int64(0)
			checkRepack := func() {
				t.Helper()
				if repackAfter != "" && repacked.Load() == repackedBefore {
					t.Fatalf("no gc run repacked after %s, which left a pack part garbage (%s)", repackAfter, counts())
				}
				repackAfter = ""
			}
			for i := 1; i <= rounds; i++ {
				name, prev := fmt.Sprintf("c%d", i), fmt.Sprintf("c%d", i-1)
				shares := i%2 == 1
				var m *manifest.Manifest
				var err error
				if shares {
					// No gc holds the location now, and none takes it
					// until the capture holds its lock.
					running.Lock()
					resume = sync.OnceFunc(running.Unlock)
					checkRepack()
					// The capture before, begun beside a gc run and
					// committed while they ran, restores whole.
					verifyIn(t, store.Sub(loc, prev), img(i-1))
					m, err = dedupOpened(ctx, loc, name, img(i), nil, resume)
					resume()
				} else {
					m, err = dedupIn(ctx, loc, name, img(i))
				}
				if err != nil {
					t.Fatalf("capture %d: %v", i, err)
				}
				if shares && m.Stats.NewChunks >= m.Stats.Chunks {
					t.Fatalf("capture %d, begun with gc held off, shared nothing with %s (%d of %d chunks new)", i, prev, m.Stats.NewChunks, m.Stats.Chunks)
				}
				// The one before goes: its chunks (the shared base among
				// them) are garbage but for the captures that share them.
				if shares {
					repackAfter, repackedBefore = "the removal of "+prev, repacked.Load()
				}
				if _, err := Remove(ctx, store.Sub(loc, prev), "", false); err != nil {
					t.Fatal(err)
				}
				// A gc run takes the location after the removal, before
				// the next capture: after a capture that shares, its
				// repack of what the removal left mostly garbage races
				// that capture. A run that had only begun before the
				// capture could still meet its lock: so the wait is for
				// one that holds the location.
				deadline := time.Now().Add(testwait.Scale(time.Minute))
				for s := locked.Load(); locked.Load() == s; {
					if time.Now().After(deadline) {
						t.Fatal("no gc run took the location for a minute (the gc loop ended?)")
					}
					time.Sleep(100 * time.Microsecond)
				}
			}
			stopGC()
			t.Log(counts())
			checkRepack()
			verifyIn(t, store.Sub(loc, fmt.Sprintf("c%d", rounds)), img(rounds))
			res, err := GCChunks(ctx, loc, 0, false, 0)
			if err != nil || res.Packs != res.Referenced+res.Removed || removed+res.Removed == 0 || repacked.Load()+int64(res.Repacked) == 0 {
				t.Fatalf("gc after the race: %+v, %v (%s during it)", res, err, counts())
			}
			verifyIn(t, store.Sub(loc, fmt.Sprintf("c%d", rounds)), img(rounds))
		})
	}
}

func TestCopyDedup(t *testing.T) {
	ctx := context.Background()
	src, dst := mem.New("src"), dir.New(t.TempDir())
	one := map[string][]byte{"pages-1.img": noise(2<<20, 20)}
	two := map[string][]byte{"pages-1.img": append(bytes.Clone(one["pages-1.img"]), noise(1<<20, 21)...)}
	for name, files := range map[string]map[string][]byte{"one": one, "two": two} {
		if _, err := dedupIn(ctx, src, name, files); err != nil {
			t.Fatal(err)
		}
	}
	r1, err := Copy(ctx, store.Sub(src, "one"), store.Sub(dst, "one"), pipeline.Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	verifyIn(t, store.Sub(dst, "one"), one)
	r2, err := Copy(ctx, store.Sub(src, "two"), store.Sub(dst, "two"), pipeline.Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	verifyIn(t, store.Sub(dst, "two"), two)
	if r2.Kept == 0 || r2.Bytes >= r1.Bytes+int64(len(two["pages-1.img"])) {
		t.Errorf("second copy kept %d packs and copied %d bytes (first: %d)", r2.Kept, r2.Bytes, r1.Bytes)
	}
	// The destination's index knows the copied chunks: a capture there
	// of the same files adds nothing.
	m, err := dedupIn(ctx, dst, "three", two)
	if err != nil {
		t.Fatal(err)
	}
	if m.Stats.NewStoredBytes != 0 {
		t.Errorf("a capture after cp added %d bytes", m.Stats.NewStoredBytes)
	}
}

// BenchmarkLoadIndexS3 is what a capture into a location of a million
// chunks spends before it can dump: loading the index from MinIO (ten
// index objects of 100k chunks, as ten captures wrote them), and the heap
// the table then holds.
func BenchmarkLoadIndexS3(b *testing.B) {
	srv := miniotest.Start(b)
	srv.MakeBucket(b, "dedup")
	st, err := s3.New(context.Background(), s3.Config{Endpoint: srv.Endpoint(), Bucket: "dedup", Prefix: "loc",
		AccessKey: srv.AccessKey(), SecretKey: srv.SecretKey(), PartSize: 16 << 20, Parallel: 4, MaxRetries: 3})
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	ctx := context.Background()
	r := rand.New(rand.NewPCG(9, 9))
	for range 10 {
		packs := []chunkstore.Pack{{ID: chunkstore.NewPackID(), Size: 1 << 40}}
		chunks := make([]chunkstore.Chunk, 100_000)
		for i := range chunks {
			for k := 0; k < 32; k += 8 {
				v := r.Uint64()
				for j := range 8 {
					chunks[i].ID[k+j] = byte(v >> (8 * j))
				}
			}
			chunks[i].Ref = chunkstore.Ref{Pack: packs[0].ID, RawLen: 1}
		}
		if _, err := chunkstore.WriteIndex(ctx, st, packs, chunks); err != nil {
			b.Fatal(err)
		}
	}
	b.ResetTimer()
	for b.Loop() {
		t, err := chunkstore.Load(ctx, st)
		if err != nil || t.Len() != 1_000_000 {
			b.Fatalf("%d chunks, %v", t.Len(), err)
		}
	}
}

// TestDedupEncrypted: encrypted checkpoints share chunks with checkpoints
// of their key only; another key's captures into the same location share
// nothing and break nothing (gc included); packs hold no plain text; a
// wrong key or none is refused naming the key needed; cp copies them.
func TestDedupEncrypted(t *testing.T) {
	keyA, _ := crypt.NewKey(bytes.Repeat([]byte{0xa}, crypt.KeySize))
	keyB, _ := crypt.NewKey(bytes.Repeat([]byte{0xb}, crypt.KeySize))
	text := bytes.Repeat([]byte("the quick brown fox jumps over the lazy dog, secretly. "), 40000)
	files := map[string][]byte{"pages-1.img": append(noise(3<<20, 40), text...), "core-1.img": []byte("core of the process")}
	for kind, loc := range locations(t) {
		t.Run(kind, func(t *testing.T) {
			ctx := context.Background()
			caps := []struct {
				name string
				key  *crypt.Key
				new  bool // adds every chunk it stores
			}{{"a1", keyA, true}, {"a2", keyA, false}, {"b1", keyB, true}, {"plain", nil, true}, {"b2", keyB, false}}
			ids := map[manifest.Hash]string{}
			for _, c := range caps {
				m, err := dedupKeyed(ctx, loc, c.name, files, c.key)
				if err != nil {
					t.Fatalf("%s: %v", c.name, err)
				}
				distinct := map[manifest.Hash]bool{}
				for _, f := range m.Files {
					for _, ch := range f.Chunks {
						if codec.ID(ch.Codec) != codec.Zero {
							distinct[ch.Hash] = true
						}
					}
				}
				if c.new && (m.Stats.NewChunks != int64(len(distinct)) || m.Stats.NewChunks == 0) {
					t.Errorf("%s added %d of its %d distinct chunks: it shares with another key's checkpoints", c.name, m.Stats.NewChunks, len(distinct))
				}
				if !c.new && m.Stats.NewStoredBytes != 0 {
					t.Errorf("%s added %d bytes; its key's first checkpoint holds them all", c.name, m.Stats.NewStoredBytes)
				}
				if (m.Encryption != nil) != (c.key != nil) || m.Format != manifest.VersionSharedChunks {
					t.Fatalf("%s: format %d, encryption %+v", c.name, m.Format, m.Encryption)
				}
				for _, f := range m.Files {
					for _, ch := range f.Chunks {
						if other, ok := ids[ch.Hash]; ok && other[0] != c.name[0] {
							t.Fatalf("chunk id %s in %s and %s, of other keys", ch.Hash, other, c.name)
						}
						ids[ch.Hash] = c.name
					}
				}
			}
			// No plain text in any pack of the encrypted checkpoints.
			objs, err := loc.List(ctx, chunkstore.PackPrefix)
			if err != nil {
				t.Fatal(err)
			}
			plain, _ := source.ReadManifest(ctx, store.Sub(loc, "plain"))
			for _, o := range objs {
				if slices.ContainsFunc(plain.Segments, func(s manifest.Segment) bool { return s.Name == o.Name }) {
					continue
				}
				r, err := loc.Open(ctx, o.Name, 0, -1)
				if err != nil {
					t.Fatal(err)
				}
				b, _ := io.ReadAll(r)
				r.Close()
				if bytes.Contains(b, text[:64]) || bytes.Contains(b, files["pages-1.img"][:64]) {
					t.Fatalf("pack %s holds plain text", o.Name)
				}
			}
			for _, c := range caps {
				verifyKeyed(t, store.Sub(loc, c.name), files, c.key)
			}
			// The wrong key, or none, is refused naming the key needed.
			for _, k := range []*crypt.Key{keyB, nil} {
				_, err := source.OpenArchive(ctx, store.Sub(loc, "a1"), pipeline.Options{Key: k})
				want := crypt.ErrWrongKey
				if k == nil {
					want = crypt.ErrNoKey
				}
				if !errors.Is(err, want) || !strings.Contains(err.Error(), keyA.ID().String()) {
					t.Errorf("a1 opened with key %v: %v, want %v naming %s", k != nil, err, want, keyA.ID())
				}
			}
			// Another key's checkpoints removed and collected: A's stay whole.
			for _, n := range []string{"b1", "b2", "a1"} {
				if _, err := Remove(ctx, store.Sub(loc, n), n, false); err != nil {
					t.Fatal(err)
				}
			}
			res, err := GCChunks(ctx, loc, 0, false, 0)
			if err != nil || res.Removed == 0 {
				t.Fatalf("gc: %+v, %v", res, err)
			}
			verifyKeyed(t, store.Sub(loc, "a2"), files, keyA)
			verifyKeyed(t, store.Sub(loc, "plain"), files, nil)
			// cp with the key, into another location.
			dst := mem.New("dst")
			if _, err := Copy(ctx, store.Sub(loc, "a2"), store.Sub(dst, "a2"), pipeline.Options{Key: keyA}, nil); err != nil {
				t.Fatal(err)
			}
			verifyKeyed(t, store.Sub(dst, "a2"), files, keyA)
			if m, err := dedupKeyed(ctx, dst, "a3", files, keyA); err != nil || m.Stats.NewStoredBytes != 0 {
				t.Fatalf("capture after cp: %v, %+v", err, m)
			}
		})
	}
}

// TestGCRepack: a pack whose chunks are mostly garbage is repacked: its
// live chunks move to a new pack, the old one goes, and checkpoints whose
// manifests name it (plain and encrypted) read every byte through the
// index; captures after it share the moved chunks; cp copies the packs
// the chunks are in now.
func TestGCRepack(t *testing.T) {
	key, _ := crypt.NewKey(bytes.Repeat([]byte{0xc}, crypt.KeySize))
	for kind, loc := range locations(t) {
		t.Run(kind, func(t *testing.T) {
			ctx := context.Background()
			big := noise(3<<20, 50)
			// small's chunks are big's first ones, but for the last cut.
			small := map[string][]byte{"pages-1.img": big[:200<<10]}
			for _, k := range []*crypt.Key{nil, key} {
				p := "plain-"
				if k != nil {
					p = "enc-"
				}
				if _, err := dedupKeyed(ctx, loc, p+"big", map[string][]byte{"pages-1.img": big}, k); err != nil {
					t.Fatal(err)
				}
				if m, err := dedupKeyed(ctx, loc, p+"small", small, k); err != nil || m.Stats.NewChunks > 1 {
					t.Fatalf("small: %v, %d new chunks", err, m.Stats.NewChunks)
				}
				if _, err := Remove(ctx, store.Sub(loc, p+"big"), "", false); err != nil {
					t.Fatal(err)
				}
			}
			before, err := chunkstore.Packs(ctx, loc)
			if err != nil {
				t.Fatal(err)
			}
			res, err := GCChunks(ctx, loc, 0, false, 0)
			if err != nil || res.Repacked < 2 || res.RepackedInto != 1 || res.Removed == 0 || len(res.Lost) != 0 {
				t.Fatalf("gc: %+v, %v", res, err)
			}
			after, err := chunkstore.Packs(ctx, loc)
			if err != nil {
				t.Fatal(err)
			}
			var old int
			for _, p := range []string{"plain-small", "enc-small"} {
				m, err := source.ReadManifest(ctx, store.Sub(loc, p))
				if err != nil {
					t.Fatal(err)
				}
				for _, s := range m.Segments {
					id, _ := chunkstore.ParsePackName(s.Name)
					if _, ok := after[id]; !ok {
						old++
					}
				}
			}
			if old == 0 || len(after) >= len(before) {
				t.Fatalf("repacking left every pack the manifests name (%d packs before, %d after)", len(before), len(after))
			}
			verifyKeyed(t, store.Sub(loc, "plain-small"), small, nil)
			verifyKeyed(t, store.Sub(loc, "enc-small"), small, key)
			// Nothing more to do; the moved chunks are found by captures.
			if res, err := GCChunks(ctx, loc, 0, false, 0); err != nil || res.Repacked != 0 || res.Removed != 0 {
				t.Fatalf("second gc: %+v, %v", res, err)
			}
			for _, k := range []*crypt.Key{nil, key} {
				if m, err := dedupKeyed(ctx, loc, fmt.Sprintf("again-%v", k != nil), small, k); err != nil || m.Stats.NewStoredBytes != 0 {
					t.Fatalf("capture after repack: %v, %+v", err, m)
				}
			}
			dst := mem.New("dst")
			if _, err := Copy(ctx, store.Sub(loc, "enc-small"), store.Sub(dst, "enc-small"), pipeline.Options{Key: key}, nil); err != nil {
				t.Fatal(err)
			}
			verifyKeyed(t, store.Sub(dst, "enc-small"), small, key)
		})
	}
}
