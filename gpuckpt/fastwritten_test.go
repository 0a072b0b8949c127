package gpuckpt

import (
	"bytes"
	"context"
	"errors"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/hostroom/cgrouptest"
	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/vram"
	"github.com/gpucr/gpucr-stream/vram/vramtest"
	"golang.org/x/sys/unix"
)

// Issue 36: only the device memory a process wrote is copied out, kept and
// stored; zero blocks come back by memset; ranges the program marks as
// caches are stored as nothing and come back as zeros. The fake driver's
// memory is host memory, so zero and written blocks are real bytes; with
// GPUCR_FAKE_POISON=1 fresh "device memory" is 0xA5, not zero, so a copy in
// that skipped a memset leaves poison that the target's check finds. And
// the files' layout, the pre-copy's, and the room for the kept copy.

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
			tg := vramtest.Start(t, env...)
			alloc, want := tg.Report(t).Bytes, tg.Written(t, tc.poison)
			if want >= alloc/2 && !tc.poison {
				t.Fatalf("the target writes %d of %d bytes: no zeros to leave out", want, alloc)
			}
			st := vramtest.NewStore()
			if tc.undo {
				st.FailAfter = 4096
			}
			o := fastOpts(tg, t)
			s, err := moveOut(ctx, []int{tg.PID}, st.Put, o)
			if err != nil {
				t.Fatal(err)
			}
			fp := s.fast.Procs()[0]
			if fp.Bytes != want || fp.Copy.Bytes != want || fp.Allocated != alloc || fp.Written != want || fp.Cached != 0 ||
				fp.Copy.Allocated != alloc || fp.Copy.Zero != alloc-want || fp.Copy.ScanError != "" {
				t.Fatalf("copied %+v, want %d of %d bytes written", fp, want, alloc)
			}
			// The kept files hold the written bytes and a page of header
			// per piece at most.
			var kept int64
			for _, k := range keptPaths(s, 0) {
				kept += vramtest.MustSize(t, k)
			}
			if kept < want || kept > want+int64(len(fp.Files)+8)*4096 {
				t.Fatalf("kept files of %d bytes for %d written", kept, want)
			}
			if tc.undo {
				if err := s.fast.Wait(ctx); err == nil {
					t.Fatal("the store did not fail")
				}
				if err := undoAll(s); err != nil {
					t.Fatal(err)
				}
				tg.MustBeIntact(t)
				return
			}
			if err := s.fast.Detach(ctx); err != nil {
				t.Fatal(err)
			}
			if err := s.fast.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			s.FastCommit()
			vramtest.CheckRecords(t, tg, st.Files)
			var stored int64
			for _, b := range st.Files {
				stored += int64(len(b))
			}
			if stored != kept {
				t.Fatalf("stored %d bytes, kept %d", stored, kept)
			}
			res, err := vram.FastResume(ctx, tg.SockDir, tg.PID, fp.Files, st.Get, nil, nil)
			cs := res.Copy
			if err != nil {
				t.Fatal(err)
			}
			if cs.Bytes != want || cs.Zero != alloc-want || cs.Allocated != alloc {
				t.Fatalf("copy in %+v, want %d bytes copied and %d set to zero", cs, want, alloc-want)
			}
			tg.MustBeIntact(t)
		})
	}
}

// TestZeroScanFails: a driver whose module lacks the zero kernel: the
// copy out stores every byte (and says why), and the round trip holds.
func TestZeroScanFails(t *testing.T) {
	tg := vramtest.Start(t, "GPUCR_FAKE_NO_ZERO_KERNEL=1")
	alloc := tg.Report(t).Bytes
	st, s := fastSuspended(t, tg, true)
	fp := s.fast.Procs()[0]
	if fp.Bytes != alloc || !strings.Contains(fp.Copy.ScanError, "gpucr_zero") {
		t.Fatalf("copy out without a zero kernel: %+v, want all %d bytes and why", fp, alloc)
	}
	if _, err := vram.FastResume(context.Background(), tg.SockDir, tg.PID, fp.Files, st.Get, nil, nil); err != nil {
		t.Fatal(err)
	}
	tg.MustBeIntact(t)
}

// TestMarkCache: a range the program marks (gpucr_mark_cache) is reported,
// not copied, kept or stored, and comes back as zeros; a marked
// allocation that the program freed is forgotten; a range outside the
// program's memory is refused (FP_MARK=bad: the target dies unless the
// call answers -2).
func TestMarkCache(t *testing.T) {
	ctx := context.Background()
	if tg := vramtest.Start(t, "FP_MARK=bad"); tg.Report(t).Cached != 0 {
		t.Fatal("a refused range is marked")
	}
	tg := vramtest.Start(t, "FP_MARK=1", "GPUCR_FAKE_POISON=1")
	if r := tg.Report(t); r.Cached != 8<<20 || r.CacheRanges != 1 {
		t.Fatalf("report: %d bytes cached in %d ranges, want the KV cache's %d in 1 (the freed one forgotten)", r.Cached, r.CacheRanges, 8<<20)
	}
	written, cached := tg.Written(t, true), vramtest.KVBlocks()*vramtest.ZBlock
	st, s := fastSuspended(t, tg, true)
	fp := s.fast.Procs()[0]
	if fp.Written != written || fp.Cached != cached || fp.Bytes != written-cached {
		t.Fatalf("copy out %+v, want %d written, %d of it cached, the rest copied", fp, written, cached)
	}
	tg.Marked = true
	vramtest.CheckRecords(t, tg, st.Files)
	if _, err := vram.FastResume(ctx, tg.SockDir, tg.PID, fp.Files, st.Get, nil, nil); err != nil {
		t.Fatal(err)
	}
	if r := tg.Check(t, 5*time.Second); !strings.HasPrefix(r, "ok ") || !strings.HasSuffix(r, "kv=dropped") {
		t.Fatalf("after the restore: %q, want the KV cache back as zeros", r)
	}
	// The files say what was left out, and why.
	var fs vram.FileStats
	for _, b := range st.Files {
		f, err := vram.ReadFileStats(bytes.NewReader(b), int64(len(b)))
		if err != nil {
			t.Fatal(err)
		}
		fs.Allocated, fs.Written, fs.Cached, fs.Data = fs.Allocated+f.Allocated, fs.Written+f.Written, fs.Cached+f.Cached, fs.Data+f.Data
	}
	if fs.Allocated != fp.Allocated || fs.Written != written || fs.Cached != cached || fs.Data != fp.Bytes {
		t.Fatalf("the files' headers say %+v, the copy %+v", fs, fp)
	}
}

// TestMarkCachePart: a mark that covers blocks only in part (all of the
// KV cache but 16 KiB at each end): the blocks wholly inside are left out
// as cached, the two at the ends are stored with their marked bytes as
// zeros, their other bytes as they were.
func TestMarkCachePart(t *testing.T) {
	tg := vramtest.Start(t, "FP_MARK=part")
	st, s := fastSuspended(t, tg, true)
	fp := s.fast.Procs()[0]
	// The KV cache's written 64 KiB blocks but the first and the last.
	if want := (vramtest.KVBlocks() - 2) * vramtest.ZBlock; fp.Cached != want {
		t.Fatalf("%d bytes cached, want %d", fp.Cached, want)
	}
	k := slices.IndexFunc(tg.Regions, func(r vramtest.Region) bool { return r.Name == "kv" })
	kv := tg.Regions[k]
	for name, b := range st.Files {
		for _, r := range vramtest.ParseRecords(t, name, b) {
			if r.VA != kv.VA {
				continue
			}
			got := vramtest.PieceBytes(b, r)
			for i := 0; i < kv.Size; i++ {
				want := tg.Want(k, i)
				if i >= 16<<10 && i < kv.Size-16<<10 {
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

// fastRound checkpoints tg into a memory store and resumes it: the VRAM
// files of that checkpoint.
func fastRound(t *testing.T, tg *vramtest.Target) map[string][]byte {
	t.Helper()
	ctx := context.Background()
	st, s := fastSuspended(t, tg, true)
	if _, err := vram.FastResume(ctx, tg.SockDir, tg.PID, s.fast.Procs()[0].Files, st.Get, nil, nil); err != nil {
		t.Fatal(err)
	}
	tg.MustBeIntact(t)
	return st.Files
}

// TestFastPathLayoutStable: the VRAM files are a function of the
// allocations (sorted by device address, each piece at a fixed place), not
// of which copy thread came first, so that a deduplicated checkpoint finds
// unchanged device memory again. Two checkpoints of the unchanged target
// differ only in the kernel's counter; after one region is rewritten, only
// in the counter and that region.
func TestFastPathLayoutStable(t *testing.T) {
	tg := vramtest.Start(t)
	first := fastRound(t, tg)
	vramtest.CheckRecords(t, tg, first)
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
		rs := vramtest.ParseRecords(t, name, first[name])
		for _, r := range rs {
			if r.Off%4096 != 0 {
				t.Fatalf("%s: record %#x's bytes at offset %d: not at a 4 KiB boundary", name, r.VA, r.Off)
			}
			if r.VA <= last {
				t.Fatalf("%s: record %#x after %#x: not in address order across the files %v", name, r.VA, last, names)
			}
			last = r.VA
		}
		pieces += len(rs)
		if len(rs) > 0 {
			nonEmpty++
		}
	}
	if pieces < 4 || nonEmpty < 3 {
		t.Fatalf("%d pieces in %d of %d files: want the pieces spread over every file", pieces, nonEmpty, len(names))
	}

	// The kernel thread keeps counting: its counter is the one change.
	if d := differing(t, tg, first, second); !slices.Equal(d, []string{"counter"}) {
		t.Fatalf("unchanged target: regions %v differ, want only the counter", d)
	}

	// Rewrite one region; the target checks it against its new pattern.
	pitch := tg.Rewrite(t, "pitch")
	third := fastRound(t, tg)
	if d := differing(t, tg, second, third); !slices.Equal(d, []string{"counter", pitch.Name}) {
		t.Fatalf("one region rewritten: regions %v differ, want the counter and %s", d, pitch.Name)
	}
	// The KV cache's written blocks rewritten, its zero blocks left zero:
	// the same bitmaps at the same places, only its data differs.
	kv := tg.Rewrite(t, "kv")
	fourth := fastRound(t, tg)
	if d := differing(t, tg, third, fourth); !slices.Equal(d, []string{"counter", kv.Name}) {
		t.Fatalf("the KV cache's written blocks rewritten: regions %v differ, want the counter and %s", d, kv.Name)
	}
	// Zero blocks were left out (the records' bitmaps), and the files hold
	// no more than the written blocks and a page of header per piece.
	var unstored bool
	var size int64
	for name, b := range fourth {
		size += int64(len(b))
		for _, r := range vramtest.ParseRecords(t, name, b) {
			unstored = unstored || strings.Trim(r.Unstored, "\x00") != ""
		}
	}
	if w := tg.Written(t, false); !unstored || size > w+int64(pieces+len(fourth))*4096 {
		t.Fatalf("%d bytes of files for %d written in %d pieces (blocks left out: %v)", size, w, pieces, unstored)
	}
}

// differing compares two checkpoints' files of tg: same records at the
// same places, and the regions whose bytes differ (by name).
func differing(t *testing.T, tg *vramtest.Target, a, b map[string][]byte) []string {
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
		ra, rb := vramtest.ParseRecords(t, name, fa), vramtest.ParseRecords(t, name, fb)
		if !slices.Equal(ra, rb) {
			t.Fatalf("%s: records %v, then %v", name, ra, rb)
		}
		for _, r := range ra {
			if bytes.Equal(fa[r.Off:r.Off+r.Data], fb[r.Off:r.Off+r.Data]) {
				continue
			}
			what := ""
			for _, g := range tg.Regions {
				if g.VA < r.VA+r.N && r.VA < g.VA+uint64(g.Size) {
					what = g.Name
				}
			}
			if what == "" {
				t.Fatalf("%s: record %#x+%d (no region) changed", name, r.VA, r.N)
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

// TestPeek: a copy out while the program runs (a migration's pre-copy)
// holds every region with its pattern, in the files and layout of the
// parked copy out that follows, and the program runs on, its memory
// intact; a peek is refused while the program is parked (as the parked
// copy out leaves it).
func TestPeek(t *testing.T) {
	tg := vramtest.Start(t)
	ctx := context.Background()
	dir := vramtest.OpenTempDir(t)
	st := vramtest.NewStore()
	n, err := vram.Peek(ctx, tg.SockDir, dir, []int{tg.PID}, 3, st.Put)
	if err != nil {
		t.Fatal(err)
	}
	if want := tg.Written(t, false); n != want {
		t.Fatalf("peeked %d bytes, the program wrote %d", n, want)
	}
	vramtest.CheckRecords(t, tg, st.Files)
	if ents, _ := dir.ReadDir(-1); len(ents) != 0 {
		t.Fatalf("peek left files: %v", ents)
	}
	if r := tg.Report(t); r.Parked {
		t.Fatal("the program is parked after a peek")
	}
	tg.MustBeIntact(t)

	// The parked copy out: the same files, each the same length, the
	// same records at the same offsets (the counter's bytes differ).
	parked, _ := fastSuspended(t, tg, false)
	for name, b := range parked.Files {
		p, ok := st.Files[name]
		if !ok || len(p) != len(b) {
			t.Fatalf("%s: %d bytes peeked, %d copied out parked", name, len(p), len(b))
		}
		if !slices.Equal(vramtest.ParseRecords(t, name, p), vramtest.ParseRecords(t, name, b)) {
			t.Fatalf("%s: the peek's records differ from the copy out's", name)
		}
	}

	p, err := preloadctl.Dial(ctx, tg.SockDir, tg.PID)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	f, err := os.CreateTemp(t.TempDir(), "peek")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Peek(ctx, []*os.File{f}); err == nil || !strings.Contains(err.Error(), "parked") {
		t.Fatalf("peek while parked: %v", err)
	}
}

// TestKeptCopyRoom (issue 36): the kept copy is host memory charged to the
// cgroup of the process whose copy threads write it. Under a memory limit
// smaller than what the process wrote, the checkpoint refuses before it
// releases anything, says how much it needs and has, and the process runs
// on with its memory (without the check the copy out would get it
// OOM-killed). Under a limit that leaves room, the round trip holds.
func TestKeptCopyRoom(t *testing.T) {
	ctx := context.Background()
	tg := vramtest.Start(t, "FP_EXTRA_MB=96")
	cg := cgrouptest.New(t, 32<<20)
	cg.Move(tg.PID)
	o := fastOpts(tg, t)
	// The kept copy on a tmpfs (as scratch mounts one): in memory.
	if err := os.MkdirAll(o.KeepDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("keep", o.KeepDir, "tmpfs", 0, "size=1g,mode=0700"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(o.KeepDir, unix.MNT_DETACH) })
	used := tg.Report(t).DeviceUsed
	_, err := moveOut(ctx, []int{tg.PID}, vramtest.NewStore().Put, o)
	if !errors.Is(err, errdefs.ErrNoRoom) || !strings.Contains(err.Error(), cg.Dir) || !strings.Contains(err.Error(), "refused before any device memory was released") {
		t.Fatalf("checkpoint under a limit of 32 MiB: %v, want refused for want of room in %s", err, cg.Dir)
	}
	if r := tg.Report(t); r.Parked || r.Released || r.DeviceUsed != used {
		t.Fatalf("after the refusal: %+v", r)
	}
	if ents, _ := os.ReadDir(o.KeepDir); len(ents) != 0 {
		t.Fatalf("a refused checkpoint wrote %d kept files", len(ents))
	}
	// Room enough (the target's own check reads its memory into buffers
	// of its own, which the small limit would not hold either): it runs
	// on intact, never OOM-killed, and the copy, charged to the cgroup,
	// fits.
	cg.SetLimit(1 << 30)
	tg.MustBeIntact(t)
	if n := cg.OOMKills(); n != 0 {
		t.Fatalf("%d OOM kills in %s", n, cg.Dir)
	}
	st := vramtest.NewStore()
	s, err := moveOut(ctx, []int{tg.PID}, st.Put, o)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.fast.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.fast.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	s.FastCommit()
	if _, err := vram.FastResume(ctx, tg.SockDir, tg.PID, s.fast.Procs()[0].Files, st.Get, nil, nil); err != nil {
		t.Fatal(err)
	}
	tg.MustBeIntact(t)
}
