package criusock

// Pages CRIU's stream-mode read skips. Restoring a task, CRIU reads its
// pages image once in pagemap order (criu/mem.c restore_priv_vma_content)
// and copies each page into the mapping it premapped; the pages of a
// mapping it does not premap (MAP_HUGETLB, or a plugin's: prepare_mappings
// passes them over) it only notes for the restorer, which reads them
// later from a second open of the image with preadv (asfile.go), and
// skips them with skip_pagemap_pages, which moves its offset and reads
// nothing. From a pipe that means the next pages come from the bytes it
// meant to skip: every mapping after a huge-page one is restored with the
// wrong contents (CRIU then fails in its restorer or, worse, does not).
// So the first serve of such a pages image leaves those pages out; the
// second, the file the restorer reads, has them all.

import (
	"context"
	"fmt"
	"sort"
	"strconv"

	mmimg "github.com/checkpoint-restore/go-criu/v7/crit/images/mm"
	"google.golang.org/protobuf/proto"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/source"
)

// vmaExtPlugin is a VMA a plugin restores (criu/include/image.h).
const vmaExtPlugin = 1 << 27

// notPremapped reads mm image img for the VMAs CRIU does not premap.
func notPremapped(img []byte) ([]vmaRange, error) {
	var out []vmaRange
	err := imageEntries(img, mmMagic, func(raw []byte, off int) error {
		var mm mmimg.MmEntry
		if err := (proto.UnmarshalOptions{AllowPartial: true}).Unmarshal(raw, &mm); err != nil {
			return fmt.Errorf("entry at offset %d: %v: %w", off, err, errdefs.ErrCorrupt)
		}
		for _, v := range mm.GetVmas() {
			s, e := v.GetStart(), v.GetEnd()
			if (v.GetFlags()&mapHugeTLB != 0 || v.GetStatus()&vmaExtPlugin != 0) && s < e && s%pageSize == 0 && e%pageSize == 0 {
				out = append(out, vmaRange{s, e})
			}
		}
		return nil
	})
	sort.Slice(out, func(i, j int) bool { return out[i].start < out[j].start })
	return out, err
}

// skippedSpans are the spans of a pages image, whose bytes are the pages
// of entries (of a plain pagemap: all present) in order, that lie in one
// of vmas (sorted).
func skippedSpans(entries []pagemapEntry, vmas []vmaRange) []source.Span {
	var out []source.Span
	var off int64
	for _, e := range entries {
		end := e.vaddr + e.nr*pageSize
		k := sort.Search(len(vmas), func(k int) bool { return vmas[k].end > e.vaddr })
		for ; k < len(vmas) && vmas[k].start < end; k++ {
			lo, hi := max(e.vaddr, vmas[k].start), min(end, vmas[k].end)
			if lo >= hi {
				continue
			}
			s := source.Span{Off: off + int64(lo-e.vaddr), Len: int64(hi - lo)}
			if m := len(out); m > 0 && out[m-1].End() >= s.Off {
				out[m-1].Len = max(out[m-1].End(), s.End()) - out[m-1].Off
			} else {
				out = append(out, s)
			}
		}
		off += int64(e.nr) * pageSize
	}
	return out
}

// noteSkips reads pagemap name as served, and its task's mm image, and
// records the spans its pages image's first serve leaves out, if any.
func (fi *fileImages) noteSkips(ctx context.Context, name string) error {
	m := pagemapName.FindStringSubmatch(name)
	if m == nil {
		return nil
	}
	mm, err := readImage(ctx, fi.src, "mm-"+m[1]+".img", maxMapImg)
	if err != nil {
		return nil // no mm image to read: CRIU fails on its own
	}
	vmas, err := notPremapped(mm)
	if err != nil || len(vmas) == 0 {
		return nil
	}
	pm, err := readImage(ctx, fi.src, name, maxMapImg)
	if err != nil {
		return err
	}
	pi, err := parsePagemap(pm)
	if err != nil || !pi.plain {
		return nil // not one CRIU's stream mode reads in one pass: CRIU judges
	}
	skips := skippedSpans(pi.entries, vmas)
	if len(skips) == 0 {
		return nil
	}
	fi.mu.Lock()
	fi.skips["pages-"+strconv.FormatUint(uint64(pi.pagesID), 10)+".img"] = skips
	fi.mu.Unlock()
	return nil
}

// firstSkips are the spans to leave out of the serve of name CRIU just
// asked for: those noted, if this is its first request.
func (fi *fileImages) firstSkips(name string) []source.Span {
	fi.mu.Lock()
	defer fi.mu.Unlock()
	if fi.asked[name] != 1 {
		return nil
	}
	return fi.skips[name]
}
