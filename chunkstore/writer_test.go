package chunkstore

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store/mem"
)

// TestWriter: a capture references the chunks the index lists, in the
// packs the index names, and the chunks it adds; its commit writes one
// index object of what it added and lists every pack referenced, with its
// size, in the order of first use. An index entry that disagrees with the
// chunk is corrupt; while a gc holds the location the index is not used.
func TestWriter(t *testing.T) {
	ctx := context.Background()
	old := Pack{ID: PackID{1}, Size: 500}
	known := Chunk{ID: manifest.Hash{0xa}, Ref: Ref{Pack: old.ID, Pos: 32, RawLen: 100, Stored: 90, Codec: 2, Checksum: 7}}
	fresh := Pack{ID: PackID{2}, Size: 300}
	added := Chunk{ID: manifest.Hash{0xb}, Ref: Ref{Pack: fresh.ID, Pos: 32, RawLen: 200, Stored: 150, Codec: 2, Checksum: 8}}
	for _, gc := range []bool{false, true} {
		st := mem.New("loc")
		first, err := WriteIndex(ctx, st, []Pack{old}, []Chunk{known})
		if err != nil {
			t.Fatal(err)
		}
		if gc {
			l, err := TakeLock(ctx, st, LockGC)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Release(ctx)
		}
		w, err := NewWriter(ctx, st)
		if err != nil {
			t.Fatal(err)
		}
		if w.Knows(known.ID) == gc {
			t.Fatalf("gc holds the location: %v; the index's chunk known: %v", gc, w.Knows(known.ID))
		}
		if _, _, err := w.Lookup(known.ID, 100, 6); !gc && !errors.Is(err, errdefs.ErrCorrupt) {
			t.Fatalf("lookup with another CRC: %v", err)
		}
		var segs []int
		if r, ok, err := w.Lookup(known.ID, 100, 7); err != nil || ok == gc || (ok && r != known.Ref) {
			t.Fatalf("lookup of the index's chunk: %+v, %v, %v", r, ok, err)
		} else if ok {
			segs = append(segs, w.Segment(r.Pack))
		}
		w.Add(added.ID, added.Ref)
		if r, ok, err := w.Lookup(added.ID, 200, 8); err != nil || !ok || r != added.Ref {
			t.Fatalf("lookup of the chunk added: %+v, %v, %v", r, ok, err)
		}
		segs = append(segs, w.Segment(fresh.ID), w.Segment(fresh.ID))
		m := &manifest.Manifest{}
		if err := w.Describe([]Pack{fresh}, m); err != nil || w.Indexed() {
			t.Fatalf("describe: %v (indexed %v)", err, w.Indexed())
		}
		if err := w.Index(ctx, []Pack{fresh}); err != nil || !w.Indexed() {
			t.Fatalf("index: %v (indexed %v)", err, w.Indexed())
		}
		w.Release(ctx)
		want := []manifest.Segment{{Name: old.ID.Name(), Size: old.Size}, {Name: fresh.ID.Name(), Size: fresh.Size}}
		if gc {
			want = want[1:]
		}
		if !slices.Equal(m.Segments, want) || !m.SharedChunks || m.Format != manifest.VersionSharedChunks ||
			m.Stats.NewChunks != 1 || m.Stats.NewStoredBytes != 150 || segs[len(segs)-1] != len(want)-1 {
			t.Fatalf("gc %v: manifest %+v, segments %v", gc, m, segs)
		}
		t2, err := Load(ctx, st)
		if err != nil {
			t.Fatal(err)
		}
		if r, ok := t2.Lookup(added.ID); !ok || r != added.Ref || t2.Len() != 2 {
			t.Fatalf("index after the commit (besides %s): %+v, %v, %d chunks", first, r, ok, t2.Len())
		}
	}
}
