package chunkstore

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/mem"
)

// TestRelocate: chunks in a pack that is there stay; chunks of a pack gone
// go where the index finds their ids; an id the index lacks, or lists with
// other lengths, is an error naming it.
func TestRelocate(t *testing.T) {
	oldP, keptP, newP := PackID{1}, PackID{2}, PackID{3}
	a, b := manifest.Hash{0xa}, manifest.Hash{0xb}
	ref := func(p PackID, pos int64) Ref {
		return Ref{Pack: p, Pos: pos, RawLen: 100, Stored: 90, Codec: 2, Checksum: 7}
	}
	man := func() *manifest.Manifest {
		return &manifest.Manifest{SharedChunks: true,
			Segments: []manifest.Segment{{Name: oldP.Name(), Size: 1000}, {Name: keptP.Name(), Size: 500}},
			Files: []manifest.File{{Name: "f", Chunks: []manifest.Chunk{
				{Offset: 0, RawLen: 100, Stored: 90, Codec: 2, Checksum: 7, Hash: a, Segment: 0, Pos: 400},
				{Offset: 100, RawLen: 100, Codec: 1},
				{Offset: 200, RawLen: 100, Stored: 90, Codec: 2, Checksum: 7, Hash: b, Segment: 1, Pos: 32},
			}}}}
	}
	for _, tc := range []struct {
		name    string
		present map[PackID]int64
		index   []Chunk
		want    []manifest.Segment // after, or nil for an error
		pos     int64              // of a, after
		err     error
	}{
		{"all there", map[PackID]int64{oldP: 1000, keptP: 500}, nil,
			[]manifest.Segment{{Name: oldP.Name(), Size: 1000}, {Name: keptP.Name(), Size: 500}}, 400, nil},
		{"repacked", map[PackID]int64{keptP: 500, newP: 200}, []Chunk{{ID: a, Ref: ref(newP, 32)}},
			[]manifest.Segment{{Name: newP.Name(), Size: 200}, {Name: keptP.Name(), Size: 500}}, 32, nil},
		{"other size is gone", map[PackID]int64{oldP: 999, keptP: 500, newP: 200}, []Chunk{{ID: a, Ref: ref(newP, 32)}},
			[]manifest.Segment{{Name: newP.Name(), Size: 200}, {Name: keptP.Name(), Size: 500}}, 32, nil},
		{"lost", map[PackID]int64{keptP: 500}, nil, nil, 0, errdefs.ErrNotFound},
		{"index pack gone too", map[PackID]int64{keptP: 500}, []Chunk{{ID: a, Ref: ref(newP, 32)}}, nil, 0, errdefs.ErrNotFound},
		{"other lengths", map[PackID]int64{keptP: 500, newP: 200}, []Chunk{{ID: a, Ref: Ref{Pack: newP, Pos: 32, RawLen: 100, Stored: 91, Codec: 2, Checksum: 7}}},
			nil, 0, errdefs.ErrCorrupt},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var packs []Pack // those the index lists
			for _, c := range tc.index {
				packs = append(packs, Pack{ID: c.Pack, Size: 200})
			}
			m := man()
			err := Relocate(m, TableOf(packs, tc.index), tc.present)
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Fatalf("err %v, want %v", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(m.Segments) != len(tc.want) {
				t.Fatalf("segments %v, want %v", m.Segments, tc.want)
			}
			for i := range tc.want {
				if m.Segments[i] != tc.want[i] {
					t.Fatalf("segments %v, want %v", m.Segments, tc.want)
				}
			}
			cs := m.Files[0].Chunks
			if m.Segments[cs[0].Segment].Name != tc.want[0].Name || cs[0].Pos != tc.pos || m.Segments[cs[2].Segment].Name != keptP.Name() || cs[2].Pos != 32 {
				t.Fatalf("chunks %+v", cs)
			}
		})
	}
}

// TestFindRepacked: a reader's view of a checkpoint in its location. Its
// chunks stay where the manifest names them while those packs are there
// (the index not read: reads of the location fail); a pack gone sends
// them where the index finds them; a chunk found nowhere while an index
// object cannot be read is an error that says how to rebuild the index. A plain checkpoint, or one
// with no location above it, is left as it is.
func TestFindRepacked(t *testing.T) {
	ctx := context.Background()
	oldP, newP := PackID{1}, PackID{2}
	a := manifest.Hash{0xa}
	chunk := manifest.Chunk{RawLen: 100, Stored: 90, Codec: 2, Checksum: 7, Hash: a, Pos: 400}
	man := func(shared bool) *manifest.Manifest {
		return &manifest.Manifest{SharedChunks: shared,
			Segments: []manifest.Segment{{Name: oldP.Name(), Size: 1000}},
			Files:    []manifest.File{{Name: "f", Chunks: []manifest.Chunk{chunk}}}}
	}
	pack := func(n int) []byte { return make([]byte, n) }
	for _, tc := range []struct {
		name    string
		objects map[string][]byte
		index   bool // an index object lists a in newP
		plain   bool
		root    bool   // the checkpoint is a store of its own
		noReads bool   // reads of the location's objects fail
		want    string // the pack a's chunk is read from, "" for an error
		errText string
	}{
		{name: "there", objects: map[string][]byte{oldP.Name(): pack(1000), newIndexName(): []byte("not read")}, noReads: true, want: oldP.Name()},
		{name: "repacked", objects: map[string][]byte{newP.Name(): pack(200)}, index: true, want: newP.Name()},
		{name: "bad index", objects: map[string][]byte{newP.Name(): pack(200), newIndexName(): []byte("garbage")},
			errText: "check --repair-index mem://loc"},
		{name: "plain", objects: map[string][]byte{}, plain: true, want: oldP.Name()},
		{name: "no location", objects: map[string][]byte{}, root: true, want: oldP.Name()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			loc := mem.New("loc")
			for name, b := range tc.objects {
				put(t, loc, name, b)
			}
			if tc.index {
				r := Ref{Pack: newP, Pos: 32, RawLen: 100, Stored: 90, Codec: 2, Checksum: 7}
				if _, err := WriteIndex(ctx, loc, []Pack{{ID: newP, Size: 200}}, []Chunk{{ID: a, Ref: r}}); err != nil {
					t.Fatal(err)
				}
			}
			var ls store.Store = loc
			if tc.noReads {
				ls = failingOpen{loc}
			}
			ckpt := store.Sub(ls, "ckpt")
			if tc.root {
				ckpt = ls
			}
			m := man(!tc.plain)
			err := FindRepacked(ctx, ckpt, m)
			if tc.want == "" {
				if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), tc.errText) {
					t.Fatalf("err %v, want one saying %q", err, tc.errText)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := m.Segments[m.Files[0].Chunks[0].Segment].Name; got != tc.want {
				t.Fatalf("chunk read from %s, want %s", got, tc.want)
			}
		})
	}
}
