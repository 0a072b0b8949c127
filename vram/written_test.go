package vram

import (
	"bytes"
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/preloadctl"
)

// Issue 36: only the device memory a process wrote is copied out, kept and
// stored; zero blocks come back by memset; ranges the program marks as
// caches are stored as nothing and come back as zeros. The fake driver's
// memory is host memory, so zero and written blocks are real bytes; with
// GPUCR_FAKE_POISON=1 fresh "device memory" is 0xA5, not zero, so a copy in
// that skipped a memset leaves poison that the target's check finds.

const zblock = 64 << 10 // the library's zero-scan block

// kvWritten: the target's KV block b (32 KiB) its "requests" wrote
// (fp_target.c, kv_written).
func kvWritten(b int) bool {
	return (b >= 1 && b <= 3) || b == 40 || (b >= 100 && b < 108) || b == 8<<20/(32<<10)-1
}

// want is region k's byte i as the target's check expects it.
func (tg *target) want(k, i int) byte {
	if tg.regions[k].name == "kv" && (tg.marked || !kvWritten(i/(32<<10))) {
		return 0
	}
	return pat(k, i)
}

// kvBlocks are the 64 KiB blocks of the KV cache that hold anything.
func kvBlocks() int64 {
	var n int64
	for b := 0; b < 8<<20/zblock; b++ {
		if kvWritten(2*b) || kvWritten(2*b+1) {
			n++
		}
	}
	return n
}

// written is what the zero scan should find written of tg's device
// memory: every block of its regions (filled with a pattern), the
// counter's, and the KV cache's written blocks; with poison, every block
// of its allocations but the KV cache's unwritten ones (the rest of each
// allocation is 0xA5).
func (tg *target) written(t *testing.T, poison bool) int64 {
	t.Helper()
	if poison {
		return tg.report(t).Bytes - (8<<20/zblock-kvBlocks())*zblock
	}
	var n int64
	for _, r := range tg.regions {
		switch r.name {
		case "imported": // another allocation's memory
		case "kv":
			n += kvBlocks() * zblock
		default:
			n += (int64(r.size) + zblock - 1) / zblock * zblock
		}
	}
	return n
}

// TestZeroBlocksNotMoved: the copy out moves, keeps and stores the written
// blocks only; the files hold nothing else but headers; the restore (and,
// with a store that fails, the undo from the kept copy) brings the data
// back and sets the rest to zero, fresh memory being poison.
func TestZeroBlocksNotMoved(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		poison bool
		undo   bool
	}{{"zeros", false, false}, {"poisoned remap", true, false}, {"undo from the kept copy", true, true}} {
		t.Run(tc.name, func(t *testing.T) {
			var env []string
			if tc.poison {
				env = append(env, "GPUCR_FAKE_POISON=1")
			}
			tg := startTarget(t, env...)
			alloc, want := tg.report(t).Bytes, tg.written(t, tc.poison)
			if want >= alloc/2 && !tc.poison {
				t.Fatalf("the target writes %d of %d bytes: no zeros to leave out", want, alloc)
			}
			st := newStore()
			if tc.undo {
				st.failAfter = 4096
			}
			o := fastOpts(tg, t)
			s, err := FastSuspend(ctx, []int{tg.pid}, st.put, o)
			if err != nil {
				t.Fatal(err)
			}
			fp := s.Procs()[0]
			if fp.Bytes != want || fp.Copy.Bytes != want || fp.Allocated != alloc || fp.Written != want || fp.Cached != 0 ||
				fp.Copy.Allocated != alloc || fp.Copy.Zero != alloc-want || fp.Copy.ScanError != "" {
				t.Fatalf("copied %+v, want %d of %d bytes written", fp, want, alloc)
			}
			// The kept files hold the written bytes and a page of header
			// per piece at most.
			var kept int64
			for _, k := range keptPaths(s, 0) {
				kept += mustSize(t, k)
			}
			if kept < want || kept > want+int64(len(fp.Files)+8)*4096 {
				t.Fatalf("kept files of %d bytes for %d written", kept, want)
			}
			if tc.undo {
				if err := s.Wait(ctx); err == nil {
					t.Fatal("the store did not fail")
				}
				if err := s.Undo(ctx); err != nil {
					t.Fatal(err)
				}
				tg.mustBeIntact(t)
				return
			}
			if err := s.Detach(ctx); err != nil {
				t.Fatal(err)
			}
			if err := s.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			s.Commit()
			checkRecords(t, tg, st.files)
			var stored int64
			for _, b := range st.files {
				stored += int64(len(b))
			}
			if stored != kept {
				t.Fatalf("stored %d bytes, kept %d", stored, kept)
			}
			_, _, cs, err := FastResume(ctx, tg.sockDir, tg.pid, fp.Files, st.get, nil)
			if err != nil {
				t.Fatal(err)
			}
			if cs.Bytes != want || cs.Zero != alloc-want || cs.Allocated != alloc {
				t.Fatalf("copy in %+v, want %d bytes copied and %d set to zero", cs, want, alloc-want)
			}
			tg.mustBeIntact(t)
		})
	}
}

// TestZeroScanFails: a driver whose module lacks the zero kernel: the
// copy out stores every byte (and says why), and the round trip holds.
func TestZeroScanFails(t *testing.T) {
	tg := startTarget(t, "GPUCR_FAKE_NO_ZERO_KERNEL=1")
	alloc := tg.report(t).Bytes
	st, s := fastSuspended(t, tg, true)
	fp := s.Procs()[0]
	if fp.Bytes != alloc || !strings.Contains(fp.Copy.ScanError, "gpucr_zero") {
		t.Fatalf("copy out without a zero kernel: %+v, want all %d bytes and why", fp, alloc)
	}
	if _, _, _, err := FastResume(context.Background(), tg.sockDir, tg.pid, fp.Files, st.get, nil); err != nil {
		t.Fatal(err)
	}
	tg.mustBeIntact(t)
}

// TestMarkCache: a range the program marks (gpucr_mark_cache) is reported,
// not copied, kept or stored, and comes back as zeros; a marked
// allocation that the program freed is forgotten; a range outside the
// program's memory is refused (FP_MARK=bad: the target dies unless the
// call answers -2).
func TestMarkCache(t *testing.T) {
	ctx := context.Background()
	if tg := startTarget(t, "FP_MARK=bad"); tg.report(t).Cached != 0 {
		t.Fatal("a refused range is marked")
	}
	tg := startTarget(t, "FP_MARK=1", "GPUCR_FAKE_POISON=1")
	if r := tg.report(t); r.Cached != 8<<20 || r.CacheRanges != 1 {
		t.Fatalf("report: %d bytes cached in %d ranges, want the KV cache's %d in 1 (the freed one forgotten)", r.Cached, r.CacheRanges, 8<<20)
	}
	written, cached := tg.written(t, true), kvBlocks()*zblock
	st, s := fastSuspended(t, tg, true)
	fp := s.Procs()[0]
	if fp.Written != written || fp.Cached != cached || fp.Bytes != written-cached {
		t.Fatalf("copy out %+v, want %d written, %d of it cached, the rest copied", fp, written, cached)
	}
	tg.marked = true
	checkRecords(t, tg, st.files)
	if _, _, _, err := FastResume(ctx, tg.sockDir, tg.pid, fp.Files, st.get, nil); err != nil {
		t.Fatal(err)
	}
	if r := tg.check(t, 5*time.Second); !strings.HasPrefix(r, "ok ") || !strings.HasSuffix(r, "kv=dropped") {
		t.Fatalf("after the restore: %q, want the KV cache back as zeros", r)
	}
	// The files say what was left out, and why.
	var fs FileStats
	for _, b := range st.files {
		f, err := ReadFileStats(bytes.NewReader(b), int64(len(b)))
		if err != nil {
			t.Fatal(err)
		}
		fs.Allocated, fs.Written, fs.Cached, fs.Data = fs.Allocated+f.Allocated, fs.Written+f.Written, fs.Cached+f.Cached, fs.Data+f.Data
	}
	if fs.Allocated != fp.Allocated || fs.Written != written || fs.Cached != cached || fs.Data != fp.Bytes {
		t.Fatalf("the files' headers say %+v, the copy %+v", fs, fp)
	}
}

// TestReportCached: the report of a process that marked nothing.
func TestReportCached(t *testing.T) {
	tg := startTarget(t)
	p, err := preloadctl.Dial(context.Background(), tg.sockDir, tg.pid)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if _, err := p.Scan(context.Background()); err == nil || !strings.Contains(err.Error(), "not parked") {
		t.Fatalf("scan while running: %v, want refused", err)
	}
	if r, err := p.Report(context.Background()); err != nil || r.Cached != 0 || r.CacheRanges != 0 {
		t.Fatalf("report: %+v %v", r, err)
	}
}

// TestMarkCachePart: a mark that covers blocks only in part (all of the
// KV cache but 16 KiB at each end): the blocks wholly inside are left out
// as cached, the two at the ends are stored with their marked bytes as
// zeros, their other bytes as they were.
func TestMarkCachePart(t *testing.T) {
	tg := startTarget(t, "FP_MARK=part")
	st, s := fastSuspended(t, tg, true)
	fp := s.Procs()[0]
	// The KV cache's written 64 KiB blocks but the first and the last.
	if want := (kvBlocks() - 2) * zblock; fp.Cached != want {
		t.Fatalf("%d bytes cached, want %d", fp.Cached, want)
	}
	k := slices.IndexFunc(tg.regions, func(r region) bool { return r.name == "kv" })
	kv := tg.regions[k]
	for name, b := range st.files {
		for _, r := range parseRecords(t, name, b) {
			if r.va != kv.va {
				continue
			}
			got := pieceBytes(b, r)
			for i := 0; i < kv.size; i++ {
				want := tg.want(k, i)
				if i >= 16<<10 && i < kv.size-16<<10 {
					want = 0
				}
				if got[i] != want {
					t.Fatalf("the KV cache's byte %d in the files: %d, want %d", i, got[i], want)
				}
			}
			return
		}
	}
	t.Fatal("the KV cache is in no record")
}
