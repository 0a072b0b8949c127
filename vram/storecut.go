package vram

// The store of a --dedup checkpoint's VRAM files, cut at the device
// blocks' boundaries (docs/FORMAT.md 17.6): the bytes before each piece's
// data (its header, bitmap, padding) one cut, then its stored blocks in
// groups of a fixed span of device memory (an eighth of the chunk size,
// whole blocks), a group cut every chunk size. So a group that did not
// change since the earlier checkpoint is the same chunks there: the new
// checkpoint names them by their ids (where the location's index holds
// them) and reads, hashes and writes none of their bytes, and its
// BlockHashes take the earlier checkpoint's hashes of the group. The other
// groups' bytes come from the kept copy, and, where the earlier checkpoint
// is not cut so (written before this rule), from that checkpoint's files;
// every block of them is hashed on the capture's workers (Visit: every
// core, a chunk at a time), and each block read back from the earlier
// checkpoint must hash as its record says before the store succeeds.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"iter"
	"sort"
	"sync/atomic"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
)

// Cut is one chunk of a VRAM file as the store cuts it: Len bytes that
// Fill reads, or (Fill nil) a chunk the location holds, named by its
// content id and CRC-32C. Visit, where set, must see the bytes before the
// put returns (it hashes their blocks).
type Cut struct {
	Len   int
	Fill  func(b []byte) error
	Hash  [32]byte
	CRC   uint32
	Visit func(b []byte)
}

// CutPut stores VRAM files as their cuts (gpuckpt: the capture's
// WriteCuts, Knows and chunk size).
type CutPut struct {
	Put       func(ctx context.Context, name string, cuts iter.Seq2[Cut, error]) error
	Knows     func(id [32]byte) bool
	ChunkSize int
}

// defaultCut is the largest cut where no CutPut says (the chunk size's
// default).
const defaultCut = 4 << 20

// fileCuts cuts one kept file of a process: its composer's skip set says
// which blocks the earlier checkpoint holds. pieces gathers the file's
// BlockHashes, complete once the put returned; checks are the blocks read
// back from the earlier checkpoint, with the hash its record gives them.
type fileCuts struct {
	ctx     context.Context
	c       *composer
	k       int
	kept    io.ReaderAt
	size    int64
	limit   uint64 // the largest cut, whole words
	span    uint64 // the device memory a group spans at most
	knows   func(id [32]byte) bool
	readers map[int]io.ReaderAt // the earlier checkpoint's files (Fill's)
	pieces  []*hashedPiece
	checks  []earlyBlock
}

// group is a piece's stored blocks first..end-1: the hashes from ord on
// (hp's from hord on), the bytes at at in the kept file (and in the new
// file), length of them.
type group struct {
	p, hp                 *hashedPiece // hp: the earlier checkpoint's, or nil
	first, end, ord, hord uint64
	at, length            uint64
}

// earlyBlock is a block read back from the earlier checkpoint: its hash
// (p.hashes[slot], once visited) must be want.
type earlyBlock struct {
	p        *hashedPiece
	slot, va uint64
	want     blockHash
}

func newFileCuts(ctx context.Context, c *composer, k int, kept io.ReaderAt, size int64, cp *CutPut) *fileCuts {
	f := &fileCuts{ctx: ctx, c: c, k: k, kept: kept, size: size, limit: defaultCut, readers: map[int]io.ReaderAt{}}
	if cp != nil {
		f.limit, f.knows = max(8, uint64(cp.ChunkSize)&^7), cp.Knows
	}
	f.span = f.limit / 8
	return f
}

// all yields the file's cuts in order; an error ends them.
func (f *fileCuts) all(yield func(Cut, error) bool) {
	fr, err := keptReader(f.kept, f.size)
	if err != nil {
		yield(Cut{}, err)
		return
	}
	head := int64(0) // where the bytes before the next piece's data begin
	for off := int64(8); ; {
		rec, next, end, err := fr.record(off)
		if err != nil {
			yield(Cut{}, err)
			return
		}
		if end {
			f.plain(head, next, yield)
			return
		}
		p := fr.piece(f.k, rec)
		p.hashes = make([]blockHash, p.ordinal(p.nblk()))
		f.pieces = append(f.pieces, p)
		if !f.plain(head, rec.start, yield) || !f.groups(p, yield) {
			return
		}
		head, off = next, next
	}
}

// plain yields the kept file's bytes from..to-1 as they are.
func (f *fileCuts) plain(from, to int64, yield func(Cut, error) bool) bool {
	for at := from; at < to; {
		n := min(to-at, int64(f.limit))
		a := at
		if !yield(Cut{Len: int(n), Fill: func(b []byte) error { return f.readKept(b, a) }}, nil) {
			return false
		}
		at += n
	}
	return true
}

func (f *fileCuts) readKept(b []byte, at int64) error {
	if err := f.ctx.Err(); err != nil {
		return context.Cause(f.ctx)
	}
	if n, err := f.kept.ReadAt(b, at); n < len(b) {
		return fmt.Errorf("kept copy at %d: %w", at+int64(n), errors.Join(err, io.ErrUnexpectedEOF))
	}
	return nil
}

// groups yields p's stored blocks, group by group: a group the earlier
// checkpoint holds unchanged, cut as this one would cut it, by its
// chunks' ids; any other by its bytes.
func (f *fileCuts) groups(p *hashedPiece, yield func(Cut, error) bool) bool {
	var hp *hashedPiece
	if e := f.c.earlier; e != nil {
		if hp = e.Hashes.find(p.va); hp != nil && (hp.size != p.size || hp.block != p.block) {
			hp = nil
		}
	}
	per := max(1, f.span/p.block)
	// ord, hord: p's and hp's ordinals of first, counted as the groups
	// go (hashedPiece.ordinal from the start each time is quadratic in
	// the piece's blocks).
	at, ord, hord := p.data, uint64(0), uint64(0)
	for first := uint64(0); first < p.nblk(); first += per {
		g := &group{p: p, hp: hp, first: first, end: min(first+per, p.nblk()), ord: ord, hord: hord, at: at}
		n := uint64(0)
		for b := g.first; b < g.end; b++ {
			if p.stored(b) {
				n++
				g.length += p.blockLen(b)
			}
			if hp != nil && hp.stored(b) {
				hord++
			}
		}
		if n == 0 {
			continue
		}
		if refs := f.refs(g); refs != nil {
			copy(p.hashes[ord:ord+n], hp.hashes[g.hord:])
			for _, r := range refs {
				if !yield(r, nil) {
					return false
				}
			}
		} else if !f.bytes(g, yield) {
			return false
		}
		at += g.length
		ord += n
	}
	return true
}

// refs are the cuts of g by the earlier checkpoint's chunks, or nil
// where g changed (a block not left out, another bitmap) or the earlier
// file's chunks there are not g's bytes alone, each one the location
// holds.
func (f *fileCuts) refs(g *group) []Cut {
	e, p, hp := f.c.earlier, g.p, g.hp
	if f.knows == nil || hp == nil || hp.file >= len(e.Chunks) {
		return nil
	}
	for b := g.first; b < g.end; b++ {
		if p.stored(b) != hp.stored(b) || p.stored(b) && !f.c.skip.has(p.va+b*p.block) {
			return nil
		}
	}
	from := hp.data + g.hord*hp.block
	cs := e.Chunks[hp.file]
	i := sort.Search(len(cs), func(i int) bool { return cs[i].Offset >= int64(from) })
	var cuts []Cut
	for at := from; at < from+g.length; i++ {
		if i == len(cs) {
			return nil
		}
		c := cs[i]
		if uint64(c.Offset) != at || codec.ID(c.Codec) == codec.Zero || uint64(c.RawLen) > f.limit ||
			at+uint64(c.RawLen) > from+g.length || !f.knows(c.Hash) {
			return nil
		}
		cuts = append(cuts, Cut{Len: int(c.RawLen), Hash: c.Hash, CRC: c.Checksum})
		at += uint64(c.RawLen)
	}
	return cuts
}

// bytes yields g's bytes, in cuts of at most the limit; the blocks of it
// left out of the copy come from the earlier checkpoint, and are noted to
// be checked against its record.
func (f *fileCuts) bytes(g *group, yield func(Cut, error) bool) bool {
	for s := range g.spans(0, g.length) {
		if va := g.p.va + s.b*g.p.block; f.c.skip.has(va) {
			if !s.held {
				yield(Cut{}, fmt.Errorf("the block at %#x was left out for an earlier checkpoint, which does not store it: %w", va, errdefs.ErrCorrupt))
				return false
			}
			f.checks = append(f.checks, earlyBlock{p: g.p, slot: s.slot, va: va, want: g.hp.hashes[s.hslot]})
		}
	}
	for off := uint64(0); off < g.length; off += f.limit {
		o := off
		cut := Cut{Len: int(min(f.limit, g.length-off)),
			Fill:  func(b []byte) error { return f.fill(g, o, b) },
			Visit: func(b []byte) { f.visit(g, o, b) }}
		if !yield(cut, nil) {
			return false
		}
	}
	return true
}

// span is a stored block b of a group: its slot among p's hashes, and
// whether hp holds it (held) at which slot of its own (hslot); pos: where
// it begins in g's bytes, lo..hi-1: the part of them a cut covers.
type span struct {
	b, slot, hslot uint64
	held           bool
	pos, lo, hi    uint64
}

// spans yields the stored blocks of g that the bytes o..o+n-1 of its
// stored bytes cover, in order.
func (g *group) spans(o, n uint64) iter.Seq[span] {
	return func(yield func(span) bool) {
		s := span{slot: g.ord, hslot: g.hord}
		for s.b = g.first; s.b < g.end && s.pos < o+n; s.b++ {
			s.held = g.hp != nil && g.hp.stored(s.b)
			if g.p.stored(s.b) {
				l := g.p.blockLen(s.b)
				if s.lo, s.hi = max(s.pos, o), min(s.pos+l, o+n); s.lo < s.hi && !yield(s) {
					return
				}
				s.pos += l
				s.slot++
			}
			if s.held {
				s.hslot++
			}
		}
	}
}

// fill reads g's bytes from o on into buf: the kept file's, then the
// earlier checkpoint's of the blocks the copy left out.
func (f *fileCuts) fill(g *group, o uint64, buf []byte) error {
	if err := f.readKept(buf, int64(g.at+o)); err != nil {
		return err
	}
	e := f.c.earlier
	for s := range g.spans(o, uint64(len(buf))) {
		if !f.c.skip.has(g.p.va + s.b*g.p.block) {
			continue
		}
		r, err := e.reader(f.ctx, f.readers, g.hp.file)
		if err != nil {
			return err
		}
		at := g.hp.data + s.hslot*g.hp.block + s.lo - s.pos
		if n, err := r.ReadAt(buf[s.lo-o:s.hi-o], int64(at)); n < int(s.hi-s.lo) {
			return fmt.Errorf("the earlier checkpoint %s: %s at %d: %w", e.Name, e.Files[g.hp.file], at, errors.Join(err, io.ErrUnexpectedEOF))
		}
	}
	return nil
}

// visit adds the hash of each part of a block in buf (g's bytes from o
// on) to the block's: a block split over cuts is summed from its parts.
func (f *fileCuts) visit(g *group, o uint64, buf []byte) {
	for s := range g.spans(o, uint64(len(buf))) {
		h := hashWords(buf[s.lo-o:s.hi-o], f.c.key, (s.lo-s.pos)/8)
		atomic.AddUint64(&g.p.hashes[s.slot][0], h[0])
		atomic.AddUint64(&g.p.hashes[s.slot][1], h[1])
	}
}

// check checks, once the put returned, the blocks read back from the
// earlier checkpoint against its record.
func (f *fileCuts) check() error {
	for _, c := range f.checks {
		if c.p.hashes[c.slot] != c.want {
			return fmt.Errorf("the earlier checkpoint %s: the block at %#x is not what its record says (damaged, or not this memory): %w",
				f.c.earlier.Name, c.va, errdefs.ErrCorrupt)
		}
	}
	return nil
}

// hashed is the file's pieces, for its process's BlockHashes.
func (f *fileCuts) hashed() []hashedPiece {
	out := make([]hashedPiece, len(f.pieces))
	for i, p := range f.pieces {
		out[i] = *p
	}
	return out
}

// cutsReader reads the bytes of cuts in turn, each filled and visited
// here: a file for a PutFunc, where no CutPut is given (and so no cut
// names a chunk).
type cutsReader struct {
	next      func() (Cut, error, bool)
	buf, rest []byte
}

func (r *cutsReader) Read(p []byte) (int, error) {
	for len(r.rest) == 0 {
		cut, err, ok := r.next()
		switch {
		case !ok:
			return 0, io.EOF
		case err != nil:
			return 0, err
		case cut.Fill == nil:
			return 0, fmt.Errorf("a cut names chunk %x, and the put takes bytes", cut.Hash)
		}
		if cap(r.buf) < cut.Len {
			r.buf = make([]byte, cut.Len)
		}
		b := r.buf[:cut.Len]
		if err := cut.Fill(b); err != nil {
			return 0, err
		}
		if cut.Visit != nil {
			cut.Visit(b)
		}
		r.rest = b
	}
	n := copy(p, r.rest)
	r.rest = r.rest[n:]
	return n, nil
}
