package chunkstore

// Index objects and the in-memory table built from them.
//
// An index object lists packs and the chunks in them (docs/FORMAT.md
// section 17.3): a 32-byte header, 24 bytes per pack, 57 bytes per chunk,
// and a CRC-32C of everything after the header. A capture writes one for
// the chunks it added; gc writes one that replaces those it rewrote. A
// location's index is the union of its index objects: an id listed twice
// (two captures that added the same chunk at the same moment) is found in
// either pack.
//
// The table keeps each chunk in 56 bytes (entry), sorted by id for a binary
// search, with the packs' names once: a million chunks take 56 MB, and a
// lookup touches no store.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"slices"
	"sort"
	"strings"
	"sync"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store"
)

// Index object layout.
const (
	IndexMagic      = "GPUCRCIX"
	indexHeaderSize = 32
	packRecordSize  = 24
	entryRecordSize = 57
	// maxIndexObject bounds one index object read into memory: about 18
	// million chunks.
	maxIndexObject = 1 << 30
	// maxPos bounds a chunk's offset in its pack (40 bits in the table).
	maxPos = 1<<40 - 1
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Ref is where a chunk is stored and what it is: enough for a manifest to
// reference it and for a reader to check the frame it reads.
type Ref struct {
	Pack     PackID
	Pos      int64  // offset of the chunk's DATA frame header in the pack
	RawLen   uint32 // raw length
	Stored   uint32 // payload length
	Codec    uint8
	Checksum uint32 // CRC-32C of the raw chunk
}

// Pack is a pack object and its committed size.
type Pack struct {
	ID   PackID
	Size int64
}

// Chunk is one chunk of an index object.
type Chunk struct {
	ID manifest.Hash
	Ref
}

// entry is a chunk in the table: 56 bytes.
type entry struct {
	id     manifest.Hash
	pack   uint32 // index into Table.packs
	pos    uint32 // low 32 bits of the offset
	raw    uint32
	stored uint32
	crc    uint32
	posHi  uint8 // bits 32..39 of the offset
	codec  uint8
}

// Table is a location's index in memory: the chunks its index objects
// list, looked up without a round trip, plus what a capture adds. Lookups
// are safe from any goroutine while Add runs.
type Table struct {
	packs   []Pack
	packIdx map[PackID]uint32
	loaded  []entry // sorted by id; only gc's repacking changes it (Marks.Moved), never its order
	// first[b] is the first entry of loaded whose id's first two bytes
	// are b or more (nil for a small table): a lookup searches the ~15
	// entries of one bucket of a million, in a cache line or two, instead
	// of probing 20 places across 56 MB. 256 KiB.
	first []uint32

	mu    sync.RWMutex
	added map[manifest.Hash]Ref

	// skipped are the index objects Load could not use.
	skipped []BadIndex
}

// BadIndex is an index object that is corrupt or truncated, and what is
// wrong with it.
type BadIndex struct {
	Name string
	Err  error
}

// Skipped are the index objects Load skipped as corrupt or truncated, by
// name: the chunks they list are not in the table.
func (t *Table) Skipped() []BadIndex { return t.skipped }

// NewTable is an empty table.
func NewTable() *Table {
	return &Table{packIdx: map[PackID]uint32{}, added: map[manifest.Hash]Ref{}}
}

// Len is how many chunks the table holds.
func (t *Table) Len() int {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return len(t.loaded) + len(t.added)
}

// Has says the table holds the chunk id.
func (t *Table) Has(id manifest.Hash) bool {
	_, ok := t.Lookup(id)
	return ok
}

// Lookup returns where the chunk id is stored.
func (t *Table) Lookup(id manifest.Hash) (Ref, bool) {
	if i, ok := t.search(id); ok {
		return t.ref(&t.loaded[i]), true
	}
	t.mu.RLock()
	r, ok := t.added[id]
	t.mu.RUnlock()
	return r, ok
}

func (t *Table) search(id manifest.Hash) (int, bool) {
	lo, hi := 0, len(t.loaded)
	if t.first != nil {
		b := int(id[0])<<8 | int(id[1])
		lo, hi = int(t.first[b]), int(t.first[b+1])
	}
	i := lo + sort.Search(hi-lo, func(i int) bool { return bytes.Compare(t.loaded[lo+i].id[:], id[:]) >= 0 })
	return i, i < hi && t.loaded[i].id == id
}

func (t *Table) ref(e *entry) Ref {
	return Ref{Pack: t.packs[e.pack].ID, Pos: int64(e.posHi)<<32 | int64(e.pos), RawLen: e.raw, Stored: e.stored, Codec: e.codec, Checksum: e.crc}
}

// Add records a chunk a capture wrote; the first Ref of an id stays.
func (t *Table) Add(id manifest.Hash, r Ref) {
	if _, ok := t.search(id); ok {
		return
	}
	t.mu.Lock()
	if _, ok := t.added[id]; !ok {
		t.added[id] = r
	}
	t.mu.Unlock()
}

// PackSize is the committed size of a pack the loaded index lists.
func (t *Table) PackSize(id PackID) (int64, bool) {
	i, ok := t.packIdx[id]
	if !ok {
		return 0, false
	}
	return t.packs[i].Size, true
}

// insert adds one index object's contents; finish sorts.
func (t *Table) insert(packs []Pack, chunks []Chunk) {
	for _, p := range packs {
		if _, ok := t.packIdx[p.ID]; !ok {
			t.packIdx[p.ID] = uint32(len(t.packs))
			t.packs = append(t.packs, p)
		}
	}
	for _, c := range chunks {
		t.loaded = append(t.loaded, entry{id: c.ID, pack: t.packIdx[c.Pack], pos: uint32(c.Pos), posHi: uint8(c.Pos >> 32),
			raw: c.RawLen, stored: c.Stored, crc: c.Checksum, codec: c.Codec})
	}
}

func (t *Table) finish() {
	t.sort()
	// Keep one entry per id (the first pack's, by sort order: any works).
	t.loaded = slices.CompactFunc(t.loaded, func(a, b entry) bool { return a.id == b.id })
	t.loaded = slices.Clip(t.loaded)
	t.buckets()
}

// sort orders the loaded entries by id; an id in several packs keeps
// them all, side by side.
func (t *Table) sort() {
	slices.SortFunc(t.loaded, func(a, b entry) int { return bytes.Compare(a.id[:], b.id[:]) })
}

// buckets fills first, for a large table.
func (t *Table) buckets() {
	t.first = nil
	if len(t.loaded) < bucketsFrom {
		return
	}
	t.first = make([]uint32, 1<<16+1)
	b := 0
	for i := range t.loaded {
		for k := int(t.loaded[i].id[0])<<8 | int(t.loaded[i].id[1]); b <= k; b++ {
			t.first[b] = uint32(i)
		}
	}
	for ; b <= 1<<16; b++ {
		t.first[b] = uint32(len(t.loaded))
	}
}

// bucketsFrom is the size of table from which lookups go through buckets
// (Table.first): where they save more than their 256 KiB costs.
const bucketsFrom = 1 << 16

// TableOf is the table of one index object's contents.
func TableOf(packs []Pack, chunks []Chunk) *Table {
	t := NewTable()
	t.insert(packs, chunks)
	t.finish()
	return t
}

// loadParallel is how many index objects are read at once.
const loadParallel = 8

// Load reads every index object of the location st into a table: one
// listing and one read per index object, several at once, each inserted
// as soon as it is read, so that what is held besides the table is the
// objects in flight.
//
// An index object that is corrupt or truncated is skipped, not fatal
// (Table.Skipped lists it): its chunks are then unknown, so a capture
// writes them again and references nothing the object claimed, and a
// reader finds a moved chunk only if another object lists it. The packs
// themselves describe their chunks (ScanPack): `check --repair-index`
// rebuilds the index from them. A store that fails, or an object of a
// newer version, still fails the load.
func Load(ctx context.Context, st store.Store) (*Table, error) {
	objs, err := st.List(ctx, IndexPrefix)
	if err != nil {
		return nil, fmt.Errorf("list chunk index of %s: %w", st, err)
	}
	t := NewTable()
	// Room for every chunk the objects' sizes allow, at once: grown by
	// doubling, the table would pass through twice its size.
	var most int64
	for _, o := range objs {
		if IsIndexName(o.Name) && o.Size > indexHeaderSize+4 && o.Size <= maxIndexObject {
			most += (o.Size - indexHeaderSize - 4) / entryRecordSize
		}
	}
	t.loaded = make([]entry, 0, most)
	var mu sync.Mutex
	var first error
	var wg sync.WaitGroup
	sem := make(chan struct{}, loadParallel)
objects:
	for _, o := range objs {
		if !IsIndexName(o.Name) {
			continue
		}
		// A goroutine per read in flight, not per object: a location of
		// ten thousand index objects (one a capture, gc not run since)
		// would hold ten thousand stacks.
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			break objects
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			packs, chunks, err := ReadIndex(ctx, st, o.Name)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case errors.Is(err, errdefs.ErrCorrupt):
				t.skipped = append(t.skipped, BadIndex{Name: o.Name, Err: err})
			case err != nil:
				if first == nil {
					first = err
				}
			default:
				t.insert(packs, chunks)
			}
		}()
	}
	wg.Wait()
	if first == nil {
		first = ctx.Err()
	}
	if first != nil {
		return nil, first
	}
	slices.SortFunc(t.skipped, func(a, b BadIndex) int { return strings.Compare(a.Name, b.Name) })
	t.finish()
	return t, nil
}

// ReadIndex reads and checks one index object.
func ReadIndex(ctx context.Context, st store.Store, name string) ([]Pack, []Chunk, error) {
	info, err := st.Stat(ctx, name)
	if err != nil {
		return nil, nil, fmt.Errorf("%s/%s: %w", st, name, err)
	}
	if info.Size > maxIndexObject {
		return nil, nil, fmt.Errorf("%s/%s: index object of %d bytes, over the limit of %d: %w", st, name, info.Size, maxIndexObject, errdefs.ErrCorrupt)
	}
	r, err := st.Open(ctx, name, 0, -1)
	if err != nil {
		return nil, nil, fmt.Errorf("%s/%s: %w", st, name, err)
	}
	defer r.Close()
	// A small buffer: Load reads hundreds of objects, and a megabyte each
	// would be garbage the collector must keep up with while the table
	// fills.
	packs, chunks, err := DecodeIndex(bufio.NewReaderSize(r, 64<<10), info.Size)
	if err != nil {
		return nil, nil, fmt.Errorf("%s/%s: %w", st, name, err)
	}
	return packs, chunks, nil
}

// MarshalIndex encodes an index object.
func MarshalIndex(packs []Pack, chunks []Chunk) ([]byte, error) {
	var b bytes.Buffer
	b.Grow(indexHeaderSize + len(packs)*packRecordSize + len(chunks)*entryRecordSize + 4)
	err := encodeIndex(&b, packs, len(chunks), func(yield func(Chunk) error) error {
		for _, c := range chunks {
			if err := yield(c); err != nil {
				return err
			}
		}
		return nil
	})
	return b.Bytes(), err
}

// encodeIndex writes an index object of packs and the n chunks each
// yields, a record at a time.
func encodeIndex(w io.Writer, packs []Pack, n int, each func(yield func(Chunk) error) error) error {
	var h [indexHeaderSize]byte
	copy(h[:], IndexMagic)
	le := binary.LittleEndian
	le.PutUint16(h[8:], manifest.VersionSharedChunks)
	le.PutUint16(h[10:], indexHeaderSize)
	le.PutUint32(h[12:], uint32(len(packs)))
	le.PutUint64(h[16:], uint64(n))
	le.PutUint32(h[28:], crc32.Checksum(h[:28], castagnoli))
	if _, err := w.Write(h[:]); err != nil {
		return err
	}
	sum := crc32.New(castagnoli)
	out := io.MultiWriter(w, sum)
	at := map[PackID]uint32{}
	rec := make([]byte, 0, entryRecordSize)
	for i, p := range packs {
		at[p.ID] = uint32(i)
		rec = le.AppendUint64(append(rec[:0], p.ID[:]...), uint64(p.Size))
		if _, err := out.Write(rec); err != nil {
			return err
		}
	}
	written := 0
	err := each(func(c Chunk) error {
		k, ok := at[c.Pack]
		if !ok {
			return fmt.Errorf("index: chunk %s in pack %x, which the index does not list", c.ID, c.Pack)
		}
		if c.Pos < 0 || c.Pos > maxPos {
			return fmt.Errorf("index: chunk %s at offset %d of its pack, over the limit of %d", c.ID, c.Pos, int64(maxPos))
		}
		rec = append(rec[:0], c.ID[:]...)
		rec = le.AppendUint32(rec, k)
		rec = le.AppendUint64(rec, uint64(c.Pos))
		rec = le.AppendUint32(rec, c.RawLen)
		rec = le.AppendUint32(rec, c.Stored)
		rec = append(rec, c.Codec)
		rec = le.AppendUint32(rec, c.Checksum)
		written++
		_, err := out.Write(rec)
		return err
	})
	if err != nil {
		return err
	}
	if written != n {
		return fmt.Errorf("index: %d chunks written, %d announced", written, n)
	}
	_, err = w.Write(le.AppendUint32(nil, sum.Sum32()))
	return err
}

// WriteTableIndex writes one new index object of the chunks of t's loaded
// index whose pack keep accepts, straight from the table (gc: no copy of a
// million chunks beside it; the chunks it repacked are in the table, moved
// by Marks.Moved), and of extra chunks, and returns its name. The packs of
// extra are t's.
func WriteTableIndex(ctx context.Context, st store.Store, t *Table, keep func(PackID) bool, extra []Chunk) (string, error) {
	var packs []Pack
	kept := make([]bool, len(t.packs))
	for k, p := range t.packs {
		if kept[k] = keep(p.ID); kept[k] {
			packs = append(packs, p)
		}
	}
	n := len(extra)
	for i := range t.loaded {
		if kept[t.loaded[i].pack] {
			n++
		}
	}
	name := newIndexName()
	w, err := st.Create(ctx, name)
	if err != nil {
		return "", fmt.Errorf("write chunk index: %w", err)
	}
	bw := bufio.NewWriterSize(w, 1<<20)
	err = encodeIndex(bw, packs, n, func(yield func(Chunk) error) error {
		for i := range t.loaded {
			e := &t.loaded[i]
			if kept[e.pack] {
				if err := yield(Chunk{ID: e.id, Ref: t.ref(e)}); err != nil {
					return err
				}
			}
		}
		for _, c := range extra {
			if err := yield(c); err != nil {
				return err
			}
		}
		return nil
	})
	if err == nil {
		err = bw.Flush()
	}
	if err == nil {
		err = w.CommitNew(ctx)
	}
	if err != nil {
		_ = w.Abort(ctx)
		return "", fmt.Errorf("write chunk index %s/%s: %w", st, name, err)
	}
	return name, nil
}

// DecodeIndex reads an index object of size bytes from r and checks it
// whole (header, lengths, every reference, the CRC) before returning
// anything; memory is bounded by size, which the caller bounds.
func DecodeIndex(r io.Reader, size int64) ([]Pack, []Chunk, error) {
	var h [indexHeaderSize]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, nil, fmt.Errorf("index header: %w: %w", err, errdefs.ErrCorrupt)
	}
	le := binary.LittleEndian
	if string(h[:8]) != IndexMagic {
		return nil, nil, fmt.Errorf("not a chunk index (magic %q): %w", h[:8], errdefs.ErrCorrupt)
	}
	if v := le.Uint16(h[8:]); v != manifest.VersionSharedChunks {
		if v > manifest.VersionSharedChunks {
			return nil, nil, fmt.Errorf("chunk index: %w: version %d, this build reads %d; upgrade gpucr-stream", manifest.ErrNewerVersion, v, manifest.VersionSharedChunks)
		}
		return nil, nil, fmt.Errorf("chunk index: version %d: %w", v, errdefs.ErrCorrupt)
	}
	if le.Uint16(h[10:]) != indexHeaderSize || crc32.Checksum(h[:28], castagnoli) != le.Uint32(h[28:]) {
		return nil, nil, fmt.Errorf("chunk index: bad header length or checksum: %w", errdefs.ErrCorrupt)
	}
	np, nc := uint64(le.Uint32(h[12:])), le.Uint64(h[16:])
	if nc > uint64(size)/entryRecordSize || np > uint64(size)/packRecordSize ||
		uint64(size) != indexHeaderSize+np*packRecordSize+nc*entryRecordSize+4 {
		return nil, nil, fmt.Errorf("chunk index: %d packs and %d chunks do not fill %d bytes: %w", np, nc, size, errdefs.ErrCorrupt)
	}
	sum := crc32.New(castagnoli)
	rd := io.TeeReader(r, sum)
	packs := make([]Pack, np)
	var rec [entryRecordSize]byte
	for i := range packs {
		if _, err := io.ReadFull(rd, rec[:packRecordSize]); err != nil {
			return nil, nil, fmt.Errorf("chunk index: pack %d: %w: %w", i, err, errdefs.ErrCorrupt)
		}
		copy(packs[i].ID[:], rec[:16])
		packs[i].Size = int64(le.Uint64(rec[16:]))
		if packs[i].Size < 0 {
			return nil, nil, fmt.Errorf("chunk index: pack %d has size %d: %w", i, packs[i].Size, errdefs.ErrCorrupt)
		}
	}
	chunks := make([]Chunk, nc)
	for i := range chunks {
		if _, err := io.ReadFull(rd, rec[:]); err != nil {
			return nil, nil, fmt.Errorf("chunk index: chunk %d: %w: %w", i, err, errdefs.ErrCorrupt)
		}
		c := &chunks[i]
		copy(c.ID[:], rec[:32])
		k := le.Uint32(rec[32:])
		pos := le.Uint64(rec[36:])
		c.RawLen, c.Stored, c.Codec, c.Checksum = le.Uint32(rec[44:]), le.Uint32(rec[48:]), rec[52], le.Uint32(rec[53:])
		if uint64(k) >= np {
			return nil, nil, fmt.Errorf("chunk index: chunk %d names pack %d of %d: %w", i, k, np, errdefs.ErrCorrupt)
		}
		c.Pack, c.Pos = packs[k].ID, int64(pos)
		if c.RawLen == 0 || c.RawLen > manifest.MaxPayload || c.Stored > manifest.MaxPayload ||
			pos > maxPos || int64(pos)+manifest.FrameSize+int64(c.Stored) > packs[k].Size {
			return nil, nil, fmt.Errorf("chunk index: chunk %d (%s) lies outside its pack or has impossible lengths: %w", i, c.ID, errdefs.ErrCorrupt)
		}
	}
	want := sum.Sum32()
	var tail [4]byte
	if _, err := io.ReadFull(r, tail[:]); err != nil {
		return nil, nil, fmt.Errorf("chunk index: checksum: %w: %w", err, errdefs.ErrCorrupt)
	}
	if got := le.Uint32(tail[:]); got != want {
		return nil, nil, fmt.Errorf("chunk index: checksum mismatch (stored %08x, computed %08x): %w", got, want, errdefs.ErrCorrupt)
	}
	return packs, chunks, nil
}

// WriteIndex writes a new index object listing chunks and their packs, and
// returns its name.
func WriteIndex(ctx context.Context, st store.Store, packs []Pack, chunks []Chunk) (string, error) {
	b, err := MarshalIndex(packs, chunks)
	if err != nil {
		return "", err
	}
	name := newIndexName()
	if err := putNew(ctx, st, name, b); err != nil {
		return "", fmt.Errorf("write chunk index: %w", err)
	}
	return name, nil
}

// IndexCheckpoint writes an index object in the location loc for the
// chunks of m, the manifest of a deduplicated checkpoint whose packs loc
// holds, that loc's index does not list yet, so that captures there share
// them: cp's, for the packs it copied (or kept from an earlier copy that
// indexed only its own checkpoint's chunks). It returns the index objects
// of loc that could not be read (Table.Skipped): the chunks they list are
// indexed again.
func IndexCheckpoint(ctx context.Context, loc store.Store, m *manifest.Manifest) ([]BadIndex, error) {
	known, err := Load(ctx, loc)
	if err != nil {
		return nil, err
	}
	used := map[int]bool{}
	var chunks []Chunk
	for _, c := range storedChunks(m) {
		if known.Has(c.Hash) {
			continue
		}
		id, _ := ParsePackName(m.Segments[c.Segment].Name)
		r := Ref{Pack: id, Pos: c.Pos, RawLen: c.RawLen, Stored: c.Stored, Codec: c.Codec, Checksum: c.Checksum}
		known.Add(c.Hash, r)
		chunks = append(chunks, Chunk{ID: c.Hash, Ref: r})
		used[c.Segment] = true
	}
	if len(chunks) == 0 {
		return known.Skipped(), nil
	}
	var packs []Pack
	for i, s := range m.Segments {
		if used[i] {
			id, _ := ParsePackName(s.Name)
			packs = append(packs, Pack{ID: id, Size: s.Size})
		}
	}
	_, err = WriteIndex(ctx, loc, packs, chunks)
	return known.Skipped(), err
}

// putNew writes a whole object that must not exist yet (CommitNew: names
// are random, so a clash is a bug or an attack, never overwritten).
func putNew(ctx context.Context, st store.Store, name string, b []byte) error {
	w, err := st.Create(ctx, name)
	if err != nil {
		return err
	}
	if _, err := w.Write(b); err != nil {
		_ = w.Abort(ctx)
		return fmt.Errorf("%s/%s: %w", st, name, err)
	}
	if err := w.CommitNew(ctx); err != nil {
		_ = w.Abort(ctx)
		return fmt.Errorf("%s/%s: %w", st, name, err)
	}
	return nil
}
