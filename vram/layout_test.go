package vram

import (
	"bytes"
	"context"
	"encoding/binary"
	"slices"
	"strings"
	"testing"
)

// vramRecord is one record of a VRAM file: a piece of device memory at va
// of n bytes, its stored blocks' data bytes from off in the file; block
// and unstored (a bitmap, bit set: not stored) say which blocks those are
// (GPUCRVM3; before, every byte is stored).
type vramRecord struct {
	va, n, block, cached uint64
	unstored             string
	off, data            int
}

// stored says whether block k of r is in the file.
func (r vramRecord) stored(k uint64) bool {
	return r.unstored == "" || r.unstored[k/8]&(1<<(k%8)) == 0
}

// parseRecords parses a VRAM file (docs/PRODUCERS.md): GPUCRVM3, each
// record's header (va, size, block, cached) and bitmap, then zeros to a 4
// KiB boundary, then the stored blocks; GPUCRVM2, every byte at the next
// 4 KiB boundary after a header of va and size; GPUCRVM1, right after it.
func parseRecords(t testing.TB, name string, b []byte) []vramRecord {
	t.Helper()
	if len(b) < 8 || (string(b[:8]) != "GPUCRVM3" && string(b[:8]) != "GPUCRVM2" && string(b[:8]) != "GPUCRVM1") {
		t.Fatalf("%s: no magic", name)
	}
	v := int(b[7] - '0')
	hn := map[bool]int{true: 32, false: 16}[v == 3]
	var rs []vramRecord
	for off := 8; ; {
		if len(b)-off < hn {
			t.Fatalf("%s: truncated at %d", name, off)
		}
		r := vramRecord{va: binary.LittleEndian.Uint64(b[off:]), n: binary.LittleEndian.Uint64(b[off+8:])}
		r.block = r.n
		if v == 3 {
			r.block, r.cached = binary.LittleEndian.Uint64(b[off+16:]), binary.LittleEndian.Uint64(b[off+24:])
		}
		off += hn
		if r.va == 0 && r.n == 0 {
			if off != len(b) {
				t.Fatalf("%s: %d bytes after the end record", name, len(b)-off)
			}
			return rs
		}
		nblk := (r.n + r.block - 1) / r.block
		if v == 3 {
			bl := int(nblk+7) / 8
			r.unstored = string(b[off : off+bl])
			off += bl
		}
		if v > 1 && off%4096 != 0 {
			pad := 4096 - off%4096
			if len(b)-off < pad || !bytes.Equal(b[off:off+pad], make([]byte, pad)) {
				t.Fatalf("%s: padding at %d before record %#x not zeros", name, off, r.va)
			}
			off += pad
		}
		r.off = off
		for k := uint64(0); k < nblk; k++ {
			if r.stored(k) {
				r.data += int(min(r.block, r.n-k*r.block))
			}
		}
		if len(b)-off < r.data {
			t.Fatalf("%s: record %#x+%d truncated", name, r.va, r.n)
		}
		rs = append(rs, r)
		off += r.data
	}
}

// pieceBytes is the device memory record r of file b stands for: its
// stored blocks, zeros for the others.
func pieceBytes(b []byte, r vramRecord) []byte {
	out := make([]byte, r.n)
	at := r.off
	for k := uint64(0); k*r.block < r.n; k++ {
		n := min(r.block, r.n-k*r.block)
		if r.stored(k) {
			copy(out[k*r.block:], b[at:at+int(n)])
			at += int(n)
		}
	}
	return out
}

// fastRound checkpoints tg into a memory store and resumes it: the VRAM
// files of that checkpoint.
func fastRound(t *testing.T, tg *target) map[string][]byte {
	t.Helper()
	ctx := context.Background()
	st, s := fastSuspended(t, tg, true)
	if _, _, _, err := FastResume(ctx, tg.sockDir, tg.pid, s.Procs()[0].Files, st.get, nil); err != nil {
		t.Fatal(err)
	}
	tg.mustBeIntact(t)
	return st.files
}

// TestFastPathLayoutStable: the VRAM files are a function of the
// allocations (sorted by device address, each piece at a fixed place), not
// of which copy thread came first, so that a deduplicated checkpoint finds
// unchanged device memory again. Two checkpoints of the unchanged target
// differ only in the kernel's counter; after one region is rewritten, only
// in the counter and that region.
func TestFastPathLayoutStable(t *testing.T) {
	tg := startTarget(t)
	first := fastRound(t, tg)
	checkRecords(t, tg, first)
	second := fastRound(t, tg)

	// Sorted by address: within each file and from one file to the next.
	names := make([]string, 0, len(first))
	for name := range first {
		names = append(names, name)
	}
	slices.Sort(names)
	var last uint64
	var pieces, nonEmpty int
	for _, name := range names {
		rs := parseRecords(t, name, first[name])
		for _, r := range rs {
			if r.off%4096 != 0 {
				t.Fatalf("%s: record %#x's bytes at offset %d: not at a 4 KiB boundary", name, r.va, r.off)
			}
			if r.va <= last {
				t.Fatalf("%s: record %#x after %#x: not in address order across the files %v", name, r.va, last, names)
			}
			last = r.va
		}
		pieces += len(rs)
		if len(rs) > 0 {
			nonEmpty++
		}
	}
	if pieces < 4 || nonEmpty < 3 {
		t.Fatalf("%d pieces in %d of %d files: want the pieces spread over every file", pieces, nonEmpty, len(names))
	}

	// differing compares two checkpoints' files: same records at the same
	// places, and the regions whose bytes differ (by name).
	differing := func(a, b map[string][]byte) []string {
		t.Helper()
		if len(a) != len(b) {
			t.Fatalf("%d files, then %d", len(a), len(b))
		}
		changed := map[string]bool{}
		for name, fa := range a {
			fb, ok := b[name]
			if !ok || len(fa) != len(fb) {
				t.Fatalf("%s: %d bytes, then %d (present %v)", name, len(fa), len(fb), ok)
			}
			ra, rb := parseRecords(t, name, fa), parseRecords(t, name, fb)
			if !slices.Equal(ra, rb) {
				t.Fatalf("%s: records %v, then %v", name, ra, rb)
			}
			for _, r := range ra {
				if bytes.Equal(fa[r.off:r.off+r.data], fb[r.off:r.off+r.data]) {
					continue
				}
				what := ""
				for _, g := range tg.regions {
					if g.va < r.va+r.n && r.va < g.va+uint64(g.size) {
						what = g.name
					}
				}
				if what == "" {
					t.Fatalf("%s: record %#x+%d (no region) changed", name, r.va, r.n)
				}
				changed[what] = true
			}
		}
		var out []string
		for k := range changed {
			out = append(out, k)
		}
		slices.Sort(out)
		return out
	}
	// The kernel thread keeps counting: its counter is the one change.
	if d := differing(first, second); !slices.Equal(d, []string{"counter"}) {
		t.Fatalf("unchanged target: regions %v differ, want only the counter", d)
	}

	// Rewrite one region; the target checks it against its new pattern.
	pitch := tg.rewrite(t, "pitch")
	third := fastRound(t, tg)
	if d := differing(second, third); !slices.Equal(d, []string{"counter", pitch.name}) {
		t.Fatalf("one region rewritten: regions %v differ, want the counter and %s", d, pitch.name)
	}
	// The KV cache's written blocks rewritten, its zero blocks left zero:
	// the same bitmaps at the same places, only its data differs.
	kv := tg.rewrite(t, "kv")
	fourth := fastRound(t, tg)
	if d := differing(third, fourth); !slices.Equal(d, []string{"counter", kv.name}) {
		t.Fatalf("the KV cache's written blocks rewritten: regions %v differ, want the counter and %s", d, kv.name)
	}
	// Zero blocks were left out (the records' bitmaps), and the files hold
	// no more than the written blocks and a page of header per piece.
	var unstored bool
	var size int64
	for name, b := range fourth {
		size += int64(len(b))
		for _, r := range parseRecords(t, name, b) {
			unstored = unstored || strings.Trim(r.unstored, "\x00") != ""
		}
	}
	if w := tg.written(t, false); !unstored || size > w+int64(pieces+len(fourth))*4096 {
		t.Fatalf("%d bytes of files for %d written in %d pieces (blocks left out: %v)", size, w, pieces, unstored)
	}
}
