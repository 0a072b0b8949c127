package chunkstore

// gc's marks: which frames of which packs the location's manifests use.
//
// A frame a manifest references is, but for rare cases, the one the table
// lists for its id, so one bit per table entry marks it: a million chunks
// take 125 KB beside the table, where a map of frames took as much again
// as the table. A frame the table does not list (a chunk two captures
// stored at the same moment, whose other copy the table keeps) is kept in
// a map of its own. Repacking moves the table's entries to the new packs
// in place, so that the new index is written from the table alone, with
// only those other frames beside it.

import (
	"cmp"
	"math/bits"
	"slices"

	"github.com/gpucr/gpucr-stream/manifest"
)

// Marks are the frames of a table's packs that manifests reference. One
// goroutine at a time; the table may be looked up meanwhile until Moved.
type Marks struct {
	t     *Table
	bits  []uint64
	other map[PackID]map[int64]int64 // frames the table does not list: offset -> length
	extra []Chunk                    // other frames moved
}

// NewMarks is an empty set of marks over t's loaded chunks.
func (t *Table) NewMarks() *Marks {
	return &Marks{t: t, bits: make([]uint64, (len(t.loaded)+63)/64), other: map[PackID]map[int64]int64{}}
}

// Frame is a marked frame of a pack: its offset and length, and the table
// entry that lists it (-1: none).
type Frame struct {
	Pos, Len int64
	entry    int
}

func (e *entry) offset() int64 { return int64(e.posHi)<<32 | int64(e.pos) }

// Mark records that a manifest references the chunk id in pack at pos,
// with stored payload bytes.
func (m *Marks) Mark(id manifest.Hash, pack PackID, pos int64, stored uint32) {
	if i, ok := m.t.search(id); ok {
		e := &m.t.loaded[i]
		if m.t.packs[e.pack].ID == pack && e.offset() == pos {
			m.bits[i/64] |= 1 << (i % 64)
			return
		}
	}
	if m.other[pack] == nil {
		m.other[pack] = map[int64]int64{}
	}
	m.other[pack][pos] = manifest.FrameSize + int64(stored)
}

// MarkManifest marks the frames the stored chunks of man (format 4) use,
// in the packs it names: after Relocate, where a reader finds them.
func (m *Marks) MarkManifest(man *manifest.Manifest) {
	for _, c := range storedChunks(man) {
		id, _ := ParsePackName(man.Segments[c.Segment].Name)
		m.Mark(c.Hash, id, c.Pos, c.Stored)
	}
}

// Live is, for each pack a marked frame lies in, the bytes of its marked
// frames.
func (m *Marks) Live() map[PackID]int64 {
	per := make([]int64, len(m.t.packs))
	m.each(func(i int, e *entry) { per[e.pack] += manifest.FrameSize + int64(e.stored) })
	out := map[PackID]int64{}
	for k, n := range per {
		if n > 0 {
			out[m.t.packs[k].ID] += n
		}
	}
	for p, frames := range m.other {
		for _, n := range frames {
			out[p] += n
		}
	}
	return out
}

// each calls f with every marked entry.
func (m *Marks) each(f func(i int, e *entry)) {
	for w, b := range m.bits {
		for ; b != 0; b &= b - 1 {
			i := w*64 + bits.TrailingZeros64(b)
			f(i, &m.t.loaded[i])
		}
	}
}

// Frames are the marked frames of the packs want accepts, each pack's in
// offset order.
func (m *Marks) Frames(want func(PackID) bool) map[PackID][]Frame {
	wanted := make([]bool, len(m.t.packs))
	for k, p := range m.t.packs {
		wanted[k] = want(p.ID)
	}
	out := map[PackID][]Frame{}
	m.each(func(i int, e *entry) {
		if wanted[e.pack] {
			p := m.t.packs[e.pack].ID
			out[p] = append(out[p], Frame{Pos: e.offset(), Len: manifest.FrameSize + int64(e.stored), entry: i})
		}
	})
	for p, frames := range m.other {
		if want(p) {
			for pos, n := range frames {
				out[p] = append(out[p], Frame{Pos: pos, Len: n, entry: -1})
			}
		}
	}
	for _, frames := range out {
		slices.SortFunc(frames, func(a, b Frame) int { return cmp.Compare(a.Pos, b.Pos) })
	}
	return out
}

// Moved records that gc copied the frame f of the chunk id to r, in a new
// pack: the table lists the chunk there from now on, or, for a frame the
// table did not list, Extra does. The table must be gc's own: no lookup
// may run from now on. Committed gives the new packs' sizes.
func (m *Marks) Moved(f Frame, id manifest.Hash, r Ref) {
	k, ok := m.t.packIdx[r.Pack]
	if !ok {
		k = uint32(len(m.t.packs))
		m.t.packIdx[r.Pack] = k
		m.t.packs = append(m.t.packs, Pack{ID: r.Pack})
	}
	if f.entry < 0 {
		m.extra = append(m.extra, Chunk{ID: id, Ref: r})
		return
	}
	e := &m.t.loaded[f.entry]
	e.pack, e.pos, e.posHi = k, uint32(r.Pos), uint8(r.Pos>>32)
}

// Committed records the sizes of the packs the moved frames went to.
func (m *Marks) Committed(packs []Pack) {
	for _, p := range packs {
		if k, ok := m.t.packIdx[p.ID]; ok {
			m.t.packs[k].Size = p.Size
		}
	}
}

// Extra are the moved frames the table does not list: the new index lists
// them beside the table's chunks.
func (m *Marks) Extra() []Chunk { return m.extra }
