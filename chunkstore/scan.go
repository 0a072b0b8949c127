package chunkstore

// Packs describe themselves: every chunk is a DATA frame whose header
// (checked by its own CRC) carries the chunk's id, lengths, codec and
// CRC-32C, the record an index object keeps of it. So what an index object
// said can always be read again from the packs (docs/FORMAT.md section
// 17.8): ScanPack reads a pack's frame headers from start to end, and
// ScanPacks a location's packs into a Scan, from which `check` verifies the
// index and the checkpoints and `check --repair-index` writes a new index.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store"
)

// DecodePack reads the pack id, of size bytes, from r: its header, each
// DATA frame's header (the payload is skipped: by a seek where r can, so
// that on a local disk only the headers are read), the END frame and the
// tail. It hands each chunk to each, in offset order, as soon as its frame
// header is checked; a damaged pack is an error wrapping
// errdefs.ErrCorrupt that names the offset, and the chunks handed on
// before it stand (their frames are whole as far as a header can tell).
// Memory is one frame header.
func DecodePack(r io.Reader, id PackID, size int64, each func(Chunk) error) error {
	var h [manifest.FrameSize]byte
	if _, err := io.ReadFull(r, h[:manifest.HeaderSize]); err != nil {
		return fmt.Errorf("pack header: %w: %w", err, errdefs.ErrCorrupt)
	}
	sh, err := manifest.UnmarshalHeader(h[:manifest.HeaderSize])
	if err != nil {
		if errors.Is(err, manifest.ErrNewerVersion) {
			return err
		}
		return fmt.Errorf("pack header: %w: %w", err, errdefs.ErrCorrupt)
	}
	if !sh.Pack || sh.Version != manifest.VersionSharedChunks || sh.ShardCount != 1 {
		return fmt.Errorf("pack header: version %d, flags %#x: not a pack: %w", sh.Version, sh.Flags, errdefs.ErrCorrupt)
	}
	pos := int64(manifest.HeaderSize)
	for {
		if pos+manifest.FrameSize > size {
			return fmt.Errorf("offset %d: the pack ends before its END frame: %w", pos, errdefs.ErrCorrupt)
		}
		if _, err := io.ReadFull(r, h[:]); err != nil {
			return fmt.Errorf("offset %d: frame header: %w: %w", pos, err, errdefs.ErrCorrupt)
		}
		fh, err := manifest.UnmarshalFrameHeader(h[:])
		if err != nil {
			return fmt.Errorf("offset %d: %w: %w", pos, err, errdefs.ErrCorrupt)
		}
		next := pos + manifest.FrameSize + int64(fh.StoredLen)
		if fh.Type == manifest.FrameEnd {
			return packEnd(r, fh, pos, size)
		}
		if fh.Type != manifest.FrameData || fh.FileID != 0 || fh.Offset != 0 || fh.RawLen == 0 ||
			codec.ID(fh.Codec) == codec.Zero || pos > maxPos || next > size {
			return fmt.Errorf("offset %d: %s frame (file %d, offset %d, %d raw and %d stored bytes, codec %d) is no chunk of a pack of %d bytes: %w",
				pos, fh.Type, fh.FileID, fh.Offset, fh.RawLen, fh.StoredLen, fh.Codec, size, errdefs.ErrCorrupt)
		}
		c := Chunk{ID: fh.Hash, Ref: Ref{Pack: id, Pos: pos, RawLen: fh.RawLen, Stored: fh.StoredLen, Codec: fh.Codec, Checksum: fh.Checksum}}
		if err := each(c); err != nil {
			return err
		}
		if err := skip(r, int64(fh.StoredLen)); err != nil {
			return fmt.Errorf("offset %d: payload of %d bytes: %w: %w", pos, fh.StoredLen, err, errdefs.ErrCorrupt)
		}
		pos = next
	}
}

// packEnd checks a pack's END frame, at pos, and the tail after it, which
// must end the pack.
func packEnd(r io.Reader, fh manifest.FrameHeader, pos, size int64) error {
	if fh.StoredLen != 0 || pos+manifest.FrameSize+manifest.TailSize != size {
		return fmt.Errorf("offset %d: END frame with %d payload bytes in a pack of %d bytes: %w", pos, fh.StoredLen, size, errdefs.ErrCorrupt)
	}
	var tail [manifest.TailSize]byte
	if _, err := io.ReadFull(r, tail[:]); err != nil {
		return fmt.Errorf("offset %d: tail: %w: %w", pos+manifest.FrameSize, err, errdefs.ErrCorrupt)
	}
	end, err := manifest.UnmarshalTail(tail[:])
	if err != nil || end != uint64(pos) {
		return fmt.Errorf("offset %d: tail does not point at the END frame at %d (%v): %w", pos+manifest.FrameSize, pos, err, errdefs.ErrCorrupt)
	}
	return nil
}

// skip passes n bytes of r: a seek where r can (a file), else a read.
func skip(r io.Reader, n int64) error {
	if s, ok := r.(io.Seeker); ok {
		_, err := s.Seek(n, io.SeekCurrent)
		return err
	}
	m, err := io.CopyN(io.Discard, r, n)
	if err == nil && m < n {
		err = io.ErrUnexpectedEOF
	}
	return err
}

// ScanPack reads the chunks of the pack id, of size bytes, in st
// (DecodePack). A pack that is damaged returns the chunks read before the
// damage and an error wrapping errdefs.ErrCorrupt; one that cannot be
// read, the store's error.
func ScanPack(ctx context.Context, st store.Store, id PackID, size int64) ([]Chunk, error) {
	r, err := st.Open(ctx, id.Name(), 0, -1)
	if err != nil {
		return nil, fmt.Errorf("%s/%s: %w", st, id.Name(), err)
	}
	defer r.Close()
	var chunks []Chunk
	err = DecodePack(r, id, size, func(c Chunk) error {
		chunks = append(chunks, c)
		return ctx.Err()
	})
	if err != nil {
		return chunks, fmt.Errorf("%s/%s: %w", st, id.Name(), err)
	}
	return chunks, nil
}

// Scan is what a location's packs hold, read from the packs themselves.
type Scan struct {
	// Packs are the packs scanned, by id.
	Packs map[PackID]*PackScan
	// Table holds every frame the packs hold, by id: an id stored in
	// several packs (two captures that wrote it at once) is in it once
	// for each, so that Holds finds each copy.
	Table *Table
}

// PackScan is what the scan found of one pack.
type PackScan struct {
	Size int64
	// Err says why the scan stopped before the pack's end (damaged), at
	// offset Upto: what lies from there on is unknown (a frame header
	// damaged hides the frames after it, which may be whole).
	Err  error
	Upto int64
}

// scanParallel is how many packs are read at once.
const scanParallel = 8

// ScanPacks reads every pack of present (id and size, as listed) in st,
// several at once. Damage to a pack is recorded in its PackScan; a pack
// gone since the listing is left out; a store that fails is an error.
// Memory: the table, 56 bytes a frame, and the chunks of the packs in
// flight.
func ScanPacks(ctx context.Context, st store.Store, present map[PackID]int64) (*Scan, error) {
	s := &Scan{Packs: make(map[PackID]*PackScan, len(present)), Table: NewTable()}
	var mu sync.Mutex
	var first error
	var wg sync.WaitGroup
	sem := make(chan struct{}, scanParallel)
	for id, size := range present {
		if ctx.Err() != nil {
			break
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			chunks, err := ScanPack(ctx, st, id, size)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case errors.Is(err, errdefs.ErrNotFound):
				return // removed since the listing
			case err != nil && !errors.Is(err, errdefs.ErrCorrupt) && !errors.Is(err, manifest.ErrNewerVersion):
				if first == nil {
					first = err
				}
				return
			}
			p := &PackScan{Size: size, Err: err, Upto: size}
			if err != nil {
				p.Upto = manifest.HeaderSize
				if n := len(chunks); n > 0 {
					p.Upto = chunks[n-1].Pos + manifest.FrameSize + int64(chunks[n-1].Stored)
				}
			}
			s.Packs[id] = p
			s.Table.insert([]Pack{{ID: id, Size: size}}, chunks)
		})
	}
	wg.Wait()
	if first == nil {
		first = ctx.Err()
	}
	if first != nil {
		return nil, first
	}
	s.Table.sort()
	s.Table.buckets()
	return s, nil
}

// Holds says the scan found the chunk id at r: a frame of that id, with
// r's lengths, codec and CRC-32C, at r's place.
func (s *Scan) Holds(id manifest.Hash, r Ref) bool {
	t := s.Table
	i, _ := t.search(id)
	for ; i < len(t.loaded) && t.loaded[i].id == id; i++ {
		if t.ref(&t.loaded[i]) == r {
			return true
		}
	}
	return false
}

// Unknown says the scan cannot tell what lies at pos in the pack id: the
// pack is damaged before pos.
func (s *Scan) Unknown(id PackID, pos int64) bool {
	p := s.Packs[id]
	return p != nil && p.Err != nil && pos >= p.Upto
}

// Stale counts the chunks of t (a loaded index) that are not where t says
// (their pack is gone, or holds another frame at that place), and names
// the first: a capture would reference them. A chunk where the scan cannot
// tell (Unknown) is not counted. Unindexed counts the frames of the scan
// whose id t lacks: a capture would store them again.
func (s *Scan) Stale(t *Table) (stale int, first string, unindexed int) {
	for i := range t.loaded {
		e := &t.loaded[i]
		if r := t.ref(e); !s.Holds(e.id, r) && !s.Unknown(r.Pack, r.Pos) {
			if stale == 0 {
				first = fmt.Sprintf("chunk %s at offset %d of %s", e.id, r.Pos, r.Pack.Name())
			}
			stale++
		}
	}
	for i := range s.Table.loaded {
		if _, ok := t.search(s.Table.loaded[i].id); !ok {
			unindexed++
		}
	}
	return stale, first, unindexed
}

// WriteIndex writes one index object listing every frame the scan found,
// and the chunks of t (the index loaded) where the scan cannot tell
// (Unknown): a damaged frame header hides the frames after it, and those
// may be whole. It returns the object's name.
func (s *Scan) WriteIndex(ctx context.Context, st store.Store, t *Table) (string, error) {
	var kept []Chunk
	for i := range t.loaded {
		e := &t.loaded[i]
		if r := t.ref(e); s.Unknown(r.Pack, r.Pos) {
			kept = append(kept, Chunk{ID: e.id, Ref: r})
		}
	}
	return WriteTableIndex(ctx, st, s.Table, func(PackID) bool { return true }, kept)
}

// CheckChunks finds every chunk of m (format 4) where a reader looks
// for it: at its place in the pack m names, when that pack is there with
// the size m gives, else where the index idx finds its id; and checks the
// frame there (sc: the location's packs, nil when it has none) is that
// chunk (docs/FORMAT.md section 17.8, step 5). A chunk the packs hold
// elsewhere, that idx does not find, is reported as needing an index
// repair; chunks only past the damage in damaged packs, as ErrPastDamage.
func CheckChunks(m *manifest.Manifest, idx *Table, sc *Scan) error {
	// Of each kind, how many, and the first.
	const lost, wrong, unknown, unindexed = 0, 1, 2, 3
	var n [4]int
	var first [4]string
	total := 0
	note := func(kind int, f *manifest.File, c *manifest.Chunk, why string) {
		if n[kind] == 0 {
			first[kind] = fmt.Sprintf("file %s, offset %d, chunk %s: %s", manifest.PrintableName(f.Name), c.Offset, c.Hash, why)
		}
		n[kind]++
	}
	for f, c := range storedChunks(m) {
		total++
		if c.Segment < 0 || c.Segment >= len(m.Segments) {
			note(lost, f, c, fmt.Sprintf("it names pack %d of %d", c.Segment, len(m.Segments)))
			continue
		}
		want := Ref{RawLen: c.RawLen, Stored: c.Stored, Codec: c.Codec, Checksum: c.Checksum}
		seg := m.Segments[c.Segment]
		if id, ok := ParsePackName(seg.Name); ok && sc != nil && sc.Packs[id] != nil && sc.Packs[id].Size == seg.Size {
			switch want.Pack, want.Pos = id, c.Pos; {
			case sc.Unknown(id, c.Pos):
				note(unknown, f, c, fmt.Sprintf("%s is damaged before offset %d", seg.Name, c.Pos))
			case !sc.Holds(c.Hash, want):
				note(wrong, f, c, fmt.Sprintf("%s holds no such frame at offset %d", seg.Name, c.Pos))
			}
			continue
		}
		if same(idx, sc, c.Hash, want) {
			continue
		}
		if sc != nil && idx != nil {
			if r, ok := idx.Lookup(c.Hash); ok && sc.Unknown(r.Pack, r.Pos) {
				note(unknown, f, c, fmt.Sprintf("the index finds it in %s, damaged before offset %d", r.Pack.Name(), r.Pos))
				continue
			}
		}
		if sc != nil && same(sc.Table, sc, c.Hash, want) {
			note(unindexed, f, c, "found only by reading the packs")
			continue
		}
		note(lost, f, c, fmt.Sprintf("its pack %s is gone and no pack holds it", manifest.PrintableName(seg.Name)))
	}
	if n[lost]+n[wrong]+n[unknown]+n[unindexed] == 0 {
		return nil
	}
	msg := fmt.Sprintf("%d of %d stored chunks are not where a reader finds them: %d in no pack, %d not the frame the manifest names",
		n[lost]+n[wrong]+n[unknown]+n[unindexed], total, n[lost], n[wrong])
	if n[unknown] > 0 {
		msg += fmt.Sprintf(", %d past the damage in a damaged pack", n[unknown])
	}
	if n[unindexed] > 0 {
		msg += fmt.Sprintf(", %d found only by reading the packs (`check --repair-index` makes them readable)", n[unindexed])
	}
	example := first[slices.IndexFunc(first[:], func(f string) bool { return f != "" })]
	if n[lost]+n[wrong]+n[unindexed] == 0 {
		return fmt.Errorf("%s (%w); first: %s", msg, ErrPastDamage, example)
	}
	return fmt.Errorf("%s; first: %s", msg, example)
}

// ErrPastDamage: a checkpoint's chunks lie where a damaged frame header
// hides them from the scan; only reading them (check --read-data) tells
// whether they are whole.
var ErrPastDamage = errors.New("unchecked: --read-data reads them")

// same says the table t finds the chunk id at a frame the scan sc holds,
// with want's lengths, codec and CRC.
func same(t *Table, sc *Scan, id manifest.Hash, want Ref) bool {
	if t == nil || sc == nil {
		return false
	}
	r, ok := t.Lookup(id)
	return ok && r.RawLen == want.RawLen && r.Stored == want.Stored && r.Codec == want.Codec && r.Checksum == want.Checksum && sc.Holds(id, r)
}
