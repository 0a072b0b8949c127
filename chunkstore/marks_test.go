package chunkstore

import (
	"bytes"
	"context"
	"maps"
	"slices"
	"testing"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store/mem"
)

// TestMarks: frames marked by the table's entries and by others (a chunk
// stored twice, whose other copy the table lists) count in their packs;
// repacked, both are in the index gc writes, at their new places, and
// the chunks of the packs gone that were not marked are not.
func TestMarks(t *testing.T) {
	packs := testPacks(3) // old ones: 0 and 1 go, 2 stays
	chunks := randomChunks(300, packs, 3)
	chunks[0].Pack = packs[0].ID
	dup := chunks[0]
	dup.Pack, dup.Pos = packs[1].ID, 1<<21
	tbl := TableOf(packs, append(slices.Clone(chunks), dup))
	listed, _ := tbl.Lookup(dup.ID)
	other := dup
	if listed == dup.Ref {
		other = chunks[0]
	}
	m := tbl.NewMarks()
	want := map[PackID]int64{}
	mark := func(c Chunk) {
		m.Mark(c.ID, c.Pack, c.Pos, c.Stored)
		want[c.Pack] += manifest.FrameSize + int64(c.Stored)
	}
	mark(other)
	for _, c := range chunks[1:] {
		if c.Pos%3 == 0 {
			mark(c)
		}
	}
	if got := m.Live(); !maps.Equal(got, want) {
		t.Fatalf("live bytes %v, want %v", got, want)
	}
	gone := func(p PackID) bool { return p == packs[0].ID || p == packs[1].ID }
	frames := m.Frames(gone)
	if _, ok := frames[packs[2].ID]; ok || len(frames) != 2 {
		t.Fatalf("frames of %d packs, want those of the two going", len(frames))
	}
	newPack := NewPackID()
	var pos int64
	// The index gc writes: the chunks of the pack kept, and the marked
	// ones where they moved; not the table's copy of dup, never marked.
	var wantIndex []Chunk
	for _, c := range chunks {
		if c.Pack == packs[2].ID {
			wantIndex = append(wantIndex, c)
		}
	}
	all := append(slices.Clone(chunks), dup)
	for p, fs := range frames {
		if !slices.IsSortedFunc(fs, func(a, b Frame) int { return int(a.Pos - b.Pos) }) {
			t.Fatalf("frames of %x out of order", p)
		}
		for _, f := range fs {
			i := slices.IndexFunc(all, func(c Chunk) bool { return c.Pack == p && c.Pos == f.Pos })
			if i < 0 || f.Len != manifest.FrameSize+int64(all[i].Stored) {
				t.Fatalf("frame at %d of %x (%d bytes) is no chunk marked", f.Pos, p, f.Len)
			}
			c := all[i]
			c.Ref = Ref{Pack: newPack, Pos: pos, RawLen: c.RawLen, Stored: c.Stored, Codec: c.Codec, Checksum: c.Checksum}
			m.Moved(f, c.ID, c.Ref)
			wantIndex = append(wantIndex, c)
			pos += f.Len
		}
	}
	if len(m.Extra()) != 1 || m.Extra()[0].ID != dup.ID {
		t.Fatalf("extra %v, want the other copy of %s alone", m.Extra(), dup.ID)
	}
	m.Committed([]Pack{{ID: newPack, Size: pos}})
	st := mem.New("loc")
	name, err := WriteTableIndex(context.Background(), st, tbl, func(p PackID) bool { return !gone(p) }, m.Extra())
	if err != nil {
		t.Fatal(err)
	}
	gotPacks, got, err := ReadIndex(context.Background(), st, name)
	if err != nil {
		t.Fatal(err)
	}
	if len(gotPacks) != 2 || !slices.Contains(gotPacks, Pack{ID: newPack, Size: pos}) || !slices.Contains(gotPacks, packs[2]) {
		t.Fatalf("packs %v", gotPacks)
	}
	order := func(a, b Chunk) int {
		if c := bytes.Compare(a.ID[:], b.ID[:]); c != 0 {
			return c
		}
		return int(a.Pos - b.Pos)
	}
	slices.SortFunc(got, order)
	slices.SortFunc(wantIndex, order)
	if !slices.Equal(got, wantIndex) {
		t.Fatalf("index of %d chunks, want %d: %v\nwant %v", len(got), len(wantIndex), got, wantIndex)
	}
}
