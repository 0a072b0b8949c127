package criusock

// Sparse pages: a restore served without the zero pages of private
// anonymous memory.
//
// CRIU dumps every page a process has touched, zeros included: a CUDA
// process carries hundreds of MB of them (pinned staging, allocator
// arenas), 40% of an NCCL rank's pages in the runs that found this. The
// archive stores them as zero chunks and costs nothing, but on restore
// CRIU reads each one out of its pipe and writes it into freshly faulted
// memory, one process after the other: that was a third of an NCCL pair's
// CRIU restore.
//
// A page that a pagemap does not list is, after CRIU's restore, a page
// never touched: in private anonymous memory that reads as zeros, exactly
// what was dumped (an inherited VMA's page the child does not list is
// dropped, MADV_DONTNEED, by CRIU's restore_priv_vma_content). So when
// CRIU asks for pagemap-N.img, the pagemap is rewritten without the pages
// that lie in the pages image's zero chunks and in a private anonymous
// VMA of mm-N.img (not a file's: a missing page there would read the
// file), and pages-ID.img is then served without those bytes (source.Omit:
// the zero chunks are skipped, never spliced). Only plain pagemaps are
// rewritten (every entry present, none in a parent image);
// anything else, or a pages image asked for before its pagemap, is served
// as it is. The archive keeps what CRIU wrote: extract is unchanged.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"sort"
	"sync"
	"sync/atomic"

	mmimg "github.com/checkpoint-restore/go-criu/v7/crit/images/mm"
	pagemapimg "github.com/checkpoint-restore/go-criu/v7/crit/images/pagemap"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/knobs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
)

const (
	pageSize     = 4096
	pagemapMagic = 0x56084025 // criu/include/magic.h
	mmMagic      = 0x57492820
	// images/pagemap.proto's flags. CRIU marks the pages of private
	// anonymous memory lazy as well as present: a lazy restore (not ours)
	// may leave them to userfaultfd, any other reads them.
	peLazy    = 1 << 1
	pePresent = 1 << 2

	vmaAreaRegular = 1 << 0 // criu/include/image.h
	vmaAreaStack   = 1 << 1
	vmaAreaHeap    = 1 << 5
	vmaAnonPrivate = 1 << 9
	mapGrowsDown   = 0x100
	mapHugeTLB     = 0x40000

	// maxMapImg bounds what is read of a pagemap or mm image (a few
	// hundred KiB for a process of tens of GB).
	maxMapImg = 256 << 20
)

var (
	pagemapName = regexp.MustCompile(`^pagemap-([0-9]+)\.img$`)
	pagesName   = regexp.MustCompile(`^pages-[0-9]+\.img$`)
	// noSparse serves every image as it is, to measure what sparse pages
	// save (GPUCR_NO_SPARSE=1).
	noSparse = knobs.NoSparse.On()
)

// sparse serves src with sparse pages (see above).
type sparse struct {
	source.Source
	log      func(string)
	mu       sync.Mutex
	pagemaps map[string]*sparsePlan // by pagemap name
	pages    map[string]*sparsePlan // by pages name, once decided
	omitted  atomic.Int64           // zero bytes left out of the pages served
}

// sparsePlan is what serves one pagemap and its pages image.
type sparsePlan struct {
	done    chan struct{} // closed once planned
	err     error
	pagemap []byte        // the rewritten pagemap; nil: both served as they are
	pages   string        // its pages image
	omit    []source.Span // what of the pages image is left out
	size    int64         // the pages image's size as served
}

// asIs is the decision for a pages image served as it is.
var asIs = &sparsePlan{}

func newSparse(src source.Source, log func(string)) *sparse {
	return &sparse{Source: src, log: log, pagemaps: map[string]*sparsePlan{}, pages: map[string]*sparsePlan{}}
}

// Omitted is the zero bytes left out of the pages images served so far.
func (s *sparse) Omitted() int64 { return s.omitted.Load() }

// Manifest forwards what it wraps (source.Manifester).
func (s *sparse) Manifest() *manifest.Manifest { return source.ManifestOf(s.Source) }

func (s *sparse) Stat(ctx context.Context, name string) (manifest.File, error) {
	f, err := s.Source.Stat(ctx, name)
	if err != nil {
		return f, err
	}
	switch p, err := s.planOf(ctx, name); {
	case err != nil:
		return f, err
	case p.pagemap == nil:
	case name == p.pages:
		f.Size = p.size
	default:
		f.Size = int64(len(p.pagemap))
	}
	return f, nil
}

func (s *sparse) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	p, err := s.planOf(ctx, name)
	switch {
	case err != nil:
		return 0, err
	case p.pagemap == nil:
		return s.Source.Copy(ctx, name, w)
	case name != p.pages:
		n, err := w.Write(p.pagemap)
		return int64(n), err
	}
	o, err := source.NewOmit(w, p.omit)
	if err != nil {
		return 0, err
	}
	if _, err := s.Source.Copy(ctx, name, o); err != nil {
		return 0, err
	}
	return p.size, nil
}

// planOf is the plan that serves name: a pagemap's (planned at its first
// request), a pages image's (decided as-is if its pagemap came second),
// or asIs for any other file.
func (s *sparse) planOf(ctx context.Context, name string) (*sparsePlan, error) {
	if pagesName.MatchString(name) {
		s.mu.Lock()
		defer s.mu.Unlock()
		if p := s.pages[name]; p != nil {
			return p, nil
		}
		s.pages[name] = asIs
		return asIs, nil
	}
	if !pagemapName.MatchString(name) {
		return asIs, nil
	}
	s.mu.Lock()
	p := s.pagemaps[name]
	if p == nil {
		p = &sparsePlan{done: make(chan struct{})}
		s.pagemaps[name] = p
		s.mu.Unlock()
		s.plan(ctx, name, p)
		close(p.done)
	} else {
		s.mu.Unlock()
	}
	select {
	case <-p.done:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if p.err != nil {
		return nil, p.err
	}
	return p, nil
}

// plan fills p for the pagemap name: its rewrite, or none. Only a failed
// read is an error; an image it cannot make sense of is logged and served
// as it is, for CRIU to judge.
func (s *sparse) plan(ctx context.Context, name string, p *sparsePlan) {
	kept, pf, err := s.planned(ctx, name, p)
	if err != nil && !errors.Is(err, errdefs.ErrCorrupt) && !errors.Is(err, errTooLarge) {
		p.err = fmt.Errorf("sparse pages: %w", err)
		return
	}
	if err != nil && s.log != nil {
		s.log(fmt.Sprintf("sparse pages: %v; serving it as it is", err))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil || len(p.omit) == 0 || s.pages[p.pages] != nil {
		// Nothing to leave out, or its pages went out as they are
		// (asked for first): the pagemap goes as it is too.
		p.pagemap, p.omit = nil, nil
		return
	}
	p.pagemap = kept
	var left int64
	for _, o := range p.omit {
		left += o.Len
	}
	p.size = pf.Size - left
	s.pages[p.pages] = p
	s.omitted.Add(left)
}

// planned reads the pagemap name, its pages image's entry and its mm
// image, and sets p.pages and p.omit; it returns the rewritten pagemap.
func (s *sparse) planned(ctx context.Context, name string, p *sparsePlan) ([]byte, manifest.File, error) {
	pm, err := readImage(ctx, s.Source, name, maxMapImg)
	if err != nil {
		return nil, manifest.File{}, err
	}
	pi, err := parsePagemap(pm)
	if err != nil {
		return nil, manifest.File{}, fmt.Errorf("%s: %w", name, err)
	}
	if !pi.plain {
		return nil, manifest.File{}, nil
	}
	p.pages = fmt.Sprintf("pages-%d.img", pi.pagesID)
	pf, err := s.Source.Stat(ctx, p.pages)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, pf, nil
	}
	if err != nil {
		return nil, pf, fmt.Errorf("%s of %s: %w", p.pages, name, err)
	}
	zero := zeroPages(pf.Chunks)
	if len(zero) == 0 {
		return nil, pf, nil
	}
	mmName := "mm-" + pagemapName.FindStringSubmatch(name)[1] + ".img"
	mm, err := readImage(ctx, s.Source, mmName, maxMapImg)
	if err != nil {
		return nil, pf, err
	}
	vmas, err := parseMM(mm)
	if err != nil {
		return nil, pf, fmt.Errorf("%s: %w", mmName, err)
	}
	kept, omit, err := sparseEntries(pi.entries, vmas, zero, pf.Size)
	if err != nil {
		return nil, pf, fmt.Errorf("%s: %w", name, err)
	}
	p.omit = omit
	return encodePagemap(pm, kept, pi.wide), pf, nil
}

// zeroPages are the whole pages of the zero chunks of a pages image,
// merged where they touch.
func zeroPages(chunks []manifest.Chunk) []source.Span {
	var out []source.Span
	for _, c := range chunks {
		if codec.ID(c.Codec) != codec.Zero {
			continue
		}
		lo := (c.Offset + pageSize - 1) &^ (pageSize - 1)
		hi := (c.Offset + int64(c.RawLen)) &^ (pageSize - 1)
		if hi <= lo {
			continue
		}
		if k := len(out); k > 0 && out[k-1].End() == lo {
			out[k-1].Len += hi - lo
		} else {
			out = append(out, source.Span{Off: lo, Len: hi - lo})
		}
	}
	return out
}

// pagemapEntry is a run of pages: nr pages from vaddr.
type pagemapEntry struct{ vaddr, nr, flags uint64 }

// vmaRange is a private anonymous VMA, [start, end).
type vmaRange struct{ start, end uint64 }

// parsePagemap reads a pagemap image: its pages image's id and its
// entries. A pagemap that is not plain (an entry not present, or in a
// parent image; a field this does not know) is served as it is.
//
// Entries are read field by field: CRIU 4 counts pages in field 5
// (nr_pages, 64 bits) and leaves the old 32-bit field 2 zero, which the
// generated types here do not know.
func parsePagemap(img []byte) (pm pagemapImage, err error) {
	first := true
	pm.plain = true
	err = imageEntries(img, pagemapMagic, func(raw []byte, off int) error {
		if first {
			first = false
			var h pagemapimg.PagemapHead
			if err := (proto.UnmarshalOptions{AllowPartial: true}).Unmarshal(raw, &h); err != nil || h.PagesId == nil {
				return fmt.Errorf("head at offset %d: not a pagemap head: %w", off, errdefs.ErrCorrupt)
			}
			pm.pagesID = h.GetPagesId()
			return nil
		}
		e, known, err := parsePagemapEntry(raw)
		if err != nil {
			return fmt.Errorf("entry at offset %d: %v: %w", off, err, errdefs.ErrCorrupt)
		}
		if !known || e.flags&^peLazy != pePresent || e.vaddr%pageSize != 0 || e.nr == 0 || e.nr > 1<<40 || e.vaddr+e.nr*pageSize < e.vaddr {
			pm.plain = false
		}
		pm.entries = append(pm.entries, pagemapEntry{vaddr: e.vaddr, nr: e.nr, flags: e.flags})
		pm.wide = pm.wide || e.wide
		return nil
	})
	if err == nil && first {
		err = fmt.Errorf("no pagemap head: %w", errdefs.ErrCorrupt)
	}
	pm.plain = pm.plain && err == nil
	return pm, err
}

// pagemapImage is what a pagemap says.
type pagemapImage struct {
	pagesID uint32
	entries []pagemapEntry
	plain   bool // every entry present, nothing else (see parsePagemap)
	wide    bool // pages counted in field 5, as CRIU 4 writes them
}

// rawPagemapEntry is a pagemap entry's fields.
type rawPagemapEntry struct {
	vaddr, nr uint64
	flags     uint64
	wide      bool // nr came in field 5
}

// parsePagemapEntry decodes one entry. known is false if it has a field
// other than vaddr (1), nr_pages (2 and 5), in_parent (3, false) and
// flags (4), or lacks vaddr or a page count.
func parsePagemapEntry(b []byte) (e rawPagemapEntry, known bool, err error) {
	var hasVaddr, hasNr bool
	known = true
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return e, false, protowire.ParseError(n)
		}
		b = b[n:]
		if typ != protowire.VarintType {
			known = false
			if n = protowire.ConsumeFieldValue(num, typ, b); n < 0 {
				return e, false, protowire.ParseError(n)
			}
			b = b[n:]
			continue
		}
		v, n := protowire.ConsumeVarint(b)
		if n < 0 {
			return e, false, protowire.ParseError(n)
		}
		b = b[n:]
		switch num {
		case 1:
			e.vaddr, hasVaddr = v, true
		case 2:
			if !e.wide {
				e.nr, hasNr = v, true
			}
		case 3:
			known = known && v == 0
		case 4:
			e.flags = v
		case 5:
			e.nr, e.wide, hasNr = v, true, true
		default:
			known = false
		}
	}
	return e, known && hasVaddr && hasNr, nil
}

// parseMM reads the private anonymous VMAs of an mm image whose missing
// pages read as zeros: not a file's, not shared, not huge pages, not a
// stack that grows down (CRIU moves its start by a guard page), and
// nothing CRIU maps in a way of its own (vDSO, AIO rings, SysV memory).
func parseMM(img []byte) ([]vmaRange, error) {
	var out []vmaRange
	seen := false
	err := imageEntries(img, mmMagic, func(raw []byte, off int) error {
		if seen {
			return fmt.Errorf("a second mm entry at offset %d: %w", off, errdefs.ErrCorrupt)
		}
		seen = true
		var mm mmimg.MmEntry
		if err := (proto.UnmarshalOptions{AllowPartial: true}).Unmarshal(raw, &mm); err != nil {
			return fmt.Errorf("entry at offset %d: %v: %w", off, err, errdefs.ErrCorrupt)
		}
		for _, v := range mm.GetVmas() {
			const allowed = vmaAreaRegular | vmaAreaStack | vmaAreaHeap | vmaAnonPrivate
			st, fl := v.GetStatus(), v.GetFlags()
			if st&(vmaAreaRegular|vmaAnonPrivate) != vmaAreaRegular|vmaAnonPrivate || st&^allowed != 0 ||
				fl&(mapGrowsDown|mapHugeTLB) != 0 {
				continue
			}
			if s, e := v.GetStart(), v.GetEnd(); s < e && s%pageSize == 0 && e%pageSize == 0 {
				out = append(out, vmaRange{s, e})
			}
		}
		return nil
	})
	if err == nil && !seen {
		err = fmt.Errorf("no mm entry: %w", errdefs.ErrCorrupt)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].start < out[j].start })
	return out, err
}

// sparseEntries cuts from entries the pages that lie both in zero (spans
// of the pages image, whose bytes are the entries' pages in order) and in
// a VMA of vmas (sorted). It returns the entries left and the spans of the
// pages image to leave out.
func sparseEntries(entries []pagemapEntry, vmas []vmaRange, zero []source.Span, size int64) (kept []pagemapEntry, omit []source.Span, err error) {
	var off int64 // where the entry's pages start in the pages image
	z := 0
	for i, e := range entries {
		n := int64(e.nr) * pageSize
		if n/pageSize != int64(e.nr) || off+n > size || off+n < off {
			return nil, nil, fmt.Errorf("entry %d (%d pages at %#x) runs past the pages image's %d bytes: %w", i, e.nr, e.vaddr, size, errdefs.ErrCorrupt)
		}
		cur := e.vaddr // the first page not yet kept or cut
		for ; z < len(zero) && zero[z].Off < off+n; z++ {
			// Whole pages only (zeroPages gives them; the entries start at
			// pages of the image).
			lo := (max(zero[z].Off, off) + pageSize - 1) &^ (pageSize - 1)
			hi := min(zero[z].End(), off+n) &^ (pageSize - 1)
			if lo < hi {
				vlo, vhi := e.vaddr+uint64(lo-off), e.vaddr+uint64(hi-off)
				k := sort.Search(len(vmas), func(k int) bool { return vmas[k].end > vlo })
				for ; k < len(vmas) && vmas[k].start < vhi; k++ {
					// max with cur: VMAs that overlap (a damaged mm image)
					// cut nothing twice.
					clo, chi := max(vlo, vmas[k].start, cur), min(vhi, vmas[k].end)
					if clo >= chi {
						continue
					}
					if cur < clo {
						kept = append(kept, pagemapEntry{cur, (clo - cur) / pageSize, e.flags})
					}
					cur = chi
					fo := off + int64(clo-e.vaddr)
					if m := len(omit); m > 0 && omit[m-1].End() == fo {
						omit[m-1].Len += int64(chi - clo)
					} else {
						omit = append(omit, source.Span{Off: fo, Len: int64(chi - clo)})
					}
				}
			}
			if zero[z].End() > off+n {
				break // it goes on into the next entry
			}
		}
		if end := e.vaddr + e.nr*pageSize; cur < end {
			kept = append(kept, pagemapEntry{cur, (end - cur) / pageSize, e.flags})
		}
		off += n
	}
	return kept, omit, nil
}

// encodePagemap is img (a plain pagemap) with its entries replaced by
// entries, their pages counted as img counted them.
func encodePagemap(img []byte, entries []pagemapEntry, wide bool) []byte {
	headLen := int(binary.LittleEndian.Uint32(img[8:]))
	out := slices.Clip(img[:12+headLen])
	out = slices.Grow(out, len(entries)*24)
	var raw []byte
	for _, e := range entries {
		raw = protowire.AppendTag(raw[:0], 1, protowire.VarintType)
		raw = protowire.AppendVarint(raw, e.vaddr)
		raw = protowire.AppendTag(raw, 2, protowire.VarintType)
		if wide {
			raw = protowire.AppendVarint(raw, 0)
		} else {
			raw = protowire.AppendVarint(raw, e.nr)
		}
		raw = protowire.AppendTag(raw, 4, protowire.VarintType)
		raw = protowire.AppendVarint(raw, e.flags)
		if wide {
			raw = protowire.AppendTag(raw, 5, protowire.VarintType)
			raw = protowire.AppendVarint(raw, e.nr)
		}
		out = binary.LittleEndian.AppendUint32(out, uint32(len(raw)))
		out = append(out, raw...)
	}
	return out
}
