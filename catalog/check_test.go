package catalog

import (
	"bytes"
	"context"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/mem"
)

// objectBytes reads a whole object.
func objectBytes(t *testing.T, st store.Store, name string) []byte {
	t.Helper()
	r, err := st.Open(context.Background(), name, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// replaceObject writes an object over whatever is there, as damage does.
func replaceObject(t *testing.T, st store.Store, name string, b []byte) {
	t.Helper()
	ctx := context.Background()
	w, err := st.Create(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(b); err != nil {
		t.Fatal(err)
	}
	if err := w.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

func indexObjects(t *testing.T, st store.Store) []string {
	t.Helper()
	objs, err := st.List(context.Background(), chunkstore.IndexPrefix)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, o := range objs {
		out = append(out, o.Name)
	}
	return out
}

// checked runs Check and fails t on an error.
func checked(t *testing.T, st store.Store, opts CheckOptions) *CheckReport {
	t.Helper()
	rep, err := Check(context.Background(), st, opts)
	if err != nil {
		t.Fatalf("check: %v", err)
	}
	if (rep.Err() == nil) != rep.OK {
		t.Fatalf("check: OK %v, Err %v", rep.OK, rep.Err())
	}
	return rep
}

func damagedNames(rep *CheckReport) []string {
	var out []string
	for _, d := range rep.Damaged {
		out = append(out, d.Name)
	}
	return out
}

// TestGCKeepsWhatABadIndexDescribed: once gc repacked a checkpoint's
// chunks, only the index finds them. With that index object corrupt, gc
// removes no pack and says why, and check names the checkpoint. A capture
// still succeeds, storing the chunks again; gc, which then finds them
// there, removes the repacked pack, and the checkpoint reads from the new
// one. check --repair-index replaces the bad object; gc then goes on as
// before.
func TestGCKeepsWhatABadIndexDescribed(t *testing.T) {
	for kind, loc := range locations(t) {
		t.Run(kind, func(t *testing.T) {
			ctx := context.Background()
			big := noise(3<<20, 60)
			small := map[string][]byte{"pages-1.img": big[:200<<10]}
			if _, err := dedupIn(ctx, loc, "big", map[string][]byte{"pages-1.img": big}); err != nil {
				t.Fatal(err)
			}
			if _, err := dedupIn(ctx, loc, "small", small); err != nil {
				t.Fatal(err)
			}
			if _, err := Remove(ctx, store.Sub(loc, "big"), "", false); err != nil {
				t.Fatal(err)
			}
			if res, err := GCChunks(ctx, loc, 0, false, 0); err != nil || res.Repacked == 0 {
				t.Fatalf("gc: %+v, %v", res, err)
			}
			idx := indexObjects(t, loc)
			if len(idx) != 1 {
				t.Fatalf("index objects after gc: %v", idx)
			}
			b := objectBytes(t, loc, idx[0])
			b[len(b)/2] ^= 0x10
			replaceObject(t, loc, idx[0], b)
			if _, err := source.OpenArchive(ctx, store.Sub(loc, "small"), pipeline.Options{}); err == nil || !strings.Contains(err.Error(), "check --repair-index") {
				t.Fatalf("open small with its index corrupt: %v", err)
			}

			before, err := chunkstore.Packs(ctx, loc)
			if err != nil {
				t.Fatal(err)
			}
			res, err := GCChunks(ctx, loc, 0, false, 0)
			if err != nil || len(res.BadIndex) != 1 || res.BadIndex[0].Name != idx[0] || res.Skipped == "" ||
				!slices.Equal(res.Unresolved, []string{Join(loc.String(), "small")}) || res.Removed+res.Repacked != 0 {
				t.Fatalf("gc with the index corrupt: %+v, %v", res, err)
			}
			after, err := chunkstore.Packs(ctx, loc)
			if err != nil || len(after) != len(before) {
				t.Fatalf("gc removed packs: %d before, %d after, %v", len(before), len(after), err)
			}
			rep := checked(t, loc, CheckOptions{})
			if rep.OK || len(rep.BadIndex) != 1 || rep.BadIndex[0].Name != idx[0] ||
				!slices.Equal(damagedNames(rep), []string{Join(loc.String(), "small")}) || !strings.Contains(rep.Damaged[0].Error, "--repair-index") {
				t.Fatalf("check: %+v", rep)
			}

			// A capture of the same chunks stores them again; small's
			// are then found through its index object, so gc accounts
			// for every chunk and removes the repacked pack: small reads
			// from the new one.
			m, err := dedupIn(ctx, loc, "again", small)
			if err != nil || m.Stats.NewStoredBytes == 0 {
				t.Fatalf("capture with the index corrupt: %v, %+v", err, m)
			}
			res, err = GCChunks(ctx, loc, 0, false, 0)
			if err != nil || len(res.BadIndex) != 1 || res.Skipped != "" || len(res.Unresolved) != 0 || res.Removed != 1 {
				t.Fatalf("gc with the chunks stored again: %+v, %v", res, err)
			}
			verifyIn(t, store.Sub(loc, "small"), small)
			if rep := checked(t, loc, CheckOptions{}); rep.OK || len(rep.BadIndex) != 1 || len(rep.Damaged) != 0 {
				t.Fatalf("check with the chunks stored again: %+v", rep)
			}
			if rep := checked(t, loc, CheckOptions{RepairIndex: true}); !rep.OK || rep.Repaired == nil || rep.Repaired.Removed != 2 {
				t.Fatalf("check --repair-index: %+v", rep)
			}
			verifyIn(t, store.Sub(loc, "small"), small)
			verifyIn(t, store.Sub(loc, "again"), small)
			if res, err := GCChunks(ctx, loc, 0, false, 0); err != nil || len(res.BadIndex)+len(res.Unresolved) != 0 || res.Skipped != "" {
				t.Fatalf("gc after the repair: %+v, %v", res, err)
			}
			verifyIn(t, store.Sub(loc, "small"), small)
			if rep := checked(t, loc, CheckOptions{ReadData: true}); !rep.OK || rep.Verified != 2 || rep.Unindexed != 0 {
				t.Fatalf("check after gc: %+v", rep)
			}
		})
	}
}

// TestCheck: a clean location of plain, deduplicated and encrypted
// checkpoints checks clean (read whole with --read-data, the encrypted one
// only with its key); each kind of damage is found and named, and put
// back, checks clean again; the index is repaired only when asked and only
// while no one else holds the location.
func TestCheck(t *testing.T) {
	key, _ := crypt.NewKey(bytes.Repeat([]byte{0xd}, crypt.KeySize))
	for kind, loc := range locations(t) {
		t.Run(kind, func(t *testing.T) {
			ctx := context.Background()
			archiveIn(t, store.Sub(loc, "plain"), 1)
			pages := noise(2<<20, 70)
			for i, n := range []string{"d1", "d2"} {
				files := map[string][]byte{"pages-1.img": pages, "core-1.img": noise(10<<10, uint64(80+i))}
				if _, err := dedupIn(ctx, loc, n, files); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := dedupKeyed(ctx, loc, "enc", map[string][]byte{"pages-1.img": pages}, key); err != nil {
				t.Fatal(err)
			}
			name := func(n string) string { return Join(loc.String(), n) }
			rep := checked(t, loc, CheckOptions{ReadData: true})
			if !rep.OK || rep.Checkpoints != 4 || rep.Dedup != 3 || rep.Verified != 3 || rep.Packs == 0 ||
				len(rep.NotRead) != 1 || rep.NotRead[0].Name != name("enc") || !strings.Contains(rep.NotRead[0].Error, key.ID().String()) {
				t.Fatalf("clean location: %+v", rep)
			}
			if rep := checked(t, loc, CheckOptions{ReadData: true, Read: pipeline.Options{Key: key}}); !rep.OK || rep.Verified != 4 || len(rep.NotRead) != 0 {
				t.Fatalf("clean location, with the key: %+v", rep)
			}

			// A plain checkpoint's segment goes.
			pm, err := source.ReadManifest(ctx, store.Sub(loc, "plain"))
			if err != nil {
				t.Fatal(err)
			}
			seg := "plain/" + pm.Segments[1].Name
			saved := objectBytes(t, loc, seg)
			if err := loc.Delete(ctx, seg); err != nil {
				t.Fatal(err)
			}
			rep = checked(t, loc, CheckOptions{})
			if rep.OK || !slices.Equal(damagedNames(rep), []string{name("plain")}) || !strings.Contains(rep.Damaged[0].Error, pm.Segments[1].Name) {
				t.Fatalf("plain checkpoint without a segment: %+v", rep)
			}
			replaceObject(t, loc, seg, saved)

			// Damage in a pack d2 uses (the chunk of core-1.img, its own):
			// a payload byte is found only by reading the data, a frame
			// header's by reading the pack.
			m2, err := source.ReadManifest(ctx, store.Sub(loc, "d2"))
			if err != nil {
				t.Fatal(err)
			}
			var c manifest.Chunk
			for _, f := range m2.Files {
				if f.Name == "core-1.img" {
					c = f.Chunks[0]
				}
			}
			pack := m2.Segments[c.Segment].Name
			saved = objectBytes(t, loc, pack)
			damage := func(at int64) {
				b := bytes.Clone(saved)
				b[at] ^= 0x20
				replaceObject(t, loc, pack, b)
			}
			damage(c.Pos + manifest.FrameSize + 100)
			if rep := checked(t, loc, CheckOptions{}); !rep.OK {
				t.Fatalf("a payload byte flipped, data not read: %+v", rep)
			}
			if rep := checked(t, loc, CheckOptions{ReadData: true}); rep.OK || !slices.Equal(damagedNames(rep), []string{name("d2")}) {
				t.Fatalf("a payload byte flipped, data read: %+v", rep)
			}
			damage(c.Pos + 5)
			rep = checked(t, loc, CheckOptions{})
			if rep.OK || len(rep.BadPacks) != 1 || rep.BadPacks[0].Name != pack || !slices.Contains(damagedNames(rep), name("d2")) {
				t.Fatalf("a frame header flipped: %+v", rep)
			}
			// Read, the chunks the damaged header hides from the scan are
			// whole but d2's own.
			rep = checked(t, loc, CheckOptions{ReadData: true})
			if rep.OK || len(rep.BadPacks) != 1 || !slices.Equal(damagedNames(rep), []string{name("d2")}) {
				t.Fatalf("a frame header flipped, data read: %+v", rep)
			}
			replaceObject(t, loc, pack, saved)
			if rep := checked(t, loc, CheckOptions{}); !rep.OK {
				t.Fatalf("damage put back: %+v", rep)
			}

			// An index object that lists a chunk in a pack that is not
			// there: captures would reference it. Repaired only when asked,
			// and only while no one holds the location.
			ghost := chunkstore.NewPackID()
			if _, err := chunkstore.WriteIndex(ctx, loc, []chunkstore.Pack{{ID: ghost, Size: 1 << 20}},
				[]chunkstore.Chunk{{ID: manifest.Hash{9}, Ref: chunkstore.Ref{Pack: ghost, Pos: 32, RawLen: 10, Stored: 10}}}); err != nil {
				t.Fatal(err)
			}
			if rep := checked(t, loc, CheckOptions{}); rep.OK || rep.StaleIndex != 1 || !strings.Contains(rep.StaleExample, ghost.Name()) || rep.Repaired != nil {
				t.Fatalf("an index entry of a pack not there: %+v", rep)
			}
			lock, err := chunkstore.TakeLock(ctx, loc, chunkstore.LockCapture)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := Check(ctx, loc, CheckOptions{RepairIndex: true}); err == nil || !strings.Contains(err.Error(), "hold the location") {
				t.Fatalf("repair while a capture holds the location: %v", err)
			}
			if rep := checked(t, loc, CheckOptions{}); rep.StaleIndex != 1 {
				t.Fatalf("check beside a capture: %+v", rep)
			}
			lock.Release(ctx)
			// Repaired while d2's pack is damaged: what the index said of
			// the frames past the damage stays, and is right once the
			// pack is whole again.
			damage(c.Pos + 5)
			n := len(indexObjects(t, loc))
			rep = checked(t, loc, CheckOptions{RepairIndex: true})
			if len(rep.BadPacks) != 1 || rep.Repaired == nil || rep.Repaired.Removed != n || !slices.Equal(indexObjects(t, loc), []string{rep.Repaired.Written}) {
				t.Fatalf("repair: %+v", rep)
			}
			replaceObject(t, loc, pack, saved)
			if rep := checked(t, loc, CheckOptions{ReadData: true, Read: pipeline.Options{Key: key}}); !rep.OK || rep.StaleIndex+rep.Unindexed != 0 || rep.Verified != 4 {
				t.Fatalf("after the repair: %+v", rep)
			}

			// A gc holding the location stops a check.
			lock, err = chunkstore.TakeLock(ctx, loc, chunkstore.LockGC)
			if err != nil {
				t.Fatal(err)
			}
			defer lock.Release(ctx)
			if _, err := Check(ctx, loc, CheckOptions{}); err == nil || !strings.Contains(err.Error(), "a gc holds") {
				t.Fatalf("check while a gc holds the location: %v", err)
			}
		})
	}
}

// TestCopyIntoBadIndex: cp of a deduplicated checkpoint into a location
// whose index object is corrupt succeeds, says so, and indexes the chunks
// it copied again: a capture there shares them.
func TestCopyIntoBadIndex(t *testing.T) {
	ctx := context.Background()
	src, dst := mem.New("src"), mem.New("dst")
	files := map[string][]byte{"pages-1.img": noise(1<<20, 90)}
	if _, err := dedupIn(ctx, src, "one", files); err != nil {
		t.Fatal(err)
	}
	if _, err := Copy(ctx, store.Sub(src, "one"), store.Sub(dst, "one"), pipeline.Options{}, nil); err != nil {
		t.Fatal(err)
	}
	idx := indexObjects(t, dst)
	replaceObject(t, dst, idx[0], objectBytes(t, dst, idx[0])[:40])
	res, err := Copy(ctx, store.Sub(src, "one"), store.Sub(dst, "two"), pipeline.Options{}, nil)
	if err != nil || len(res.BadIndex) != 1 || res.BadIndex[0].Name != idx[0] || !strings.Contains(res.BadIndex[0].Error, idx[0]) {
		t.Fatalf("cp into a location with a truncated index object: %+v, %v", res, err)
	}
	verifyIn(t, store.Sub(dst, "two"), files)
	if m, err := dedupIn(ctx, dst, "three", files); err != nil || m.Stats.NewStoredBytes != 0 {
		t.Fatalf("capture after the cp: %v, %+v", err, m)
	}
}

// BenchmarkCheckFleet is check of the location of BenchmarkGCFleet
// (-fleet-chunks, -fleet-checkpoints) on a directory: the time and the
// peaks of the Go heap while it runs. Run it with -benchtime 1x.
func BenchmarkCheckFleet(b *testing.B) {
	f := fleetOf(*fleetChunks, *fleetCkpts)
	ctx := context.Background()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		path := b.TempDir()
		f.buildFor(b, dir.New(path))
		loc := dir.New(path)
		w := watchHeap()
		b.StartTimer()
		start := time.Now()
		rep, err := Check(ctx, loc, CheckOptions{})
		took := time.Since(start)
		b.StopTimer()
		heap, live, before := w.end()
		if err != nil || !rep.OK || rep.Unindexed != 0 {
			b.Fatalf("check: %+v, %v", rep, err)
		}
		b.Logf("check in %s: %d checkpoints, %d packs, %d chunks; peak heap %.1f MiB, peak live heap %.1f MiB (%.1f MiB before)",
			took.Round(time.Millisecond), rep.Checkpoints, rep.Packs, rep.Chunks, heap, live, before)
		b.ReportMetric(heap, "peak-heap-MiB")
		b.ReportMetric(live, "peak-live-MiB")
	}
}
