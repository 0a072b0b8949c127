package gpuckpt

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/vram"
	"github.com/gpucr/gpucr-stream/vram/vramtest"
)

// Issue 36 item 3: a --dedup checkpoint copies out and keeps only what
// changed since an earlier checkpoint of the process in the location; the
// store and any undo take the rest from that checkpoint, every block
// checked against its hash. Here the location is checkpoints in memory
// (dedupStores, the vram.Dedup's Find); gpuckpt's own Find over a real
// location is TestFastDedupLocation's.

// dedupStores are a location's checkpoints in memory, by name.
type dedupStores struct {
	mu     sync.Mutex
	byName map[string]*vramtest.Store
	// spoil: what the earlier checkpoints' VRAM files read from now on
	// is not what they held (every byte flipped past the magic).
	spoil atomic.Bool
	notes []string
}

func newDedupStores() *dedupStores { return &dedupStores{byName: map[string]*vramtest.Store{}} }

// find is the vram.Dedup's Find: the checkpoint name as an earlier one of
// process pid.
func (d *dedupStores) find(_ context.Context, pid int, name string) (*vram.Earlier, string, error) {
	d.mu.Lock()
	st := d.byName[name]
	d.mu.Unlock()
	if st == nil {
		return nil, "mem/" + name + " is gone", nil
	}
	b, ok := st.Files[fmt.Sprintf("vram-%d.hashes", pid)]
	if !ok {
		return nil, "mem/" + name + " holds no block hashes", nil
	}
	h, err := vram.ParseBlockHashes(b)
	if err != nil {
		return nil, "", err
	}
	var files []string
	for f := range st.Files {
		if p, ok := vram.FilePID(f); ok && p == pid {
			files = append(files, f)
		}
	}
	slices.Sort(files)
	return &vram.Earlier{Name: "mem/" + name, Hashes: h, Files: files, Open: func(_ context.Context, f string) (io.ReaderAt, error) {
		b, ok := st.Files[f]
		if !ok {
			return nil, errdefs.ErrNotFound
		}
		if d.spoil.Load() {
			b = bytes.Clone(b)
			for i := 8; i < len(b); i++ {
				b[i] ^= 0xff
			}
		}
		return bytes.NewReader(b), nil
	}}, "", nil
}

// open is `gpu resume --pid`'s way to the earlier checkpoint (vram.OpenEarlier).
func (d *dedupStores) open(ctx context.Context, where string, pid int) (*vram.Earlier, func(), error) {
	e, why, err := d.find(ctx, pid, strings.TrimPrefix(where, "mem/"))
	if e == nil && err == nil {
		err = errors.New(why)
	}
	return e, func() {}, err
}

// opts are tg's fast-path options for the checkpoint name of the location.
func (d *dedupStores) opts(t *testing.T, tg *vramtest.Target, name string) vram.FastOptions {
	o := fastOpts(tg, t)
	o.Dedup = &vram.Dedup{Loc: 0x10c, Name: name, Find: d.find, Note: func(s string) {
		d.mu.Lock()
		d.notes = append(d.notes, s)
		d.mu.Unlock()
	}}
	return o
}

// noted is the notes said since the last call.
func (d *dedupStores) noted() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := strings.Join(d.notes, "\n")
	d.notes = nil
	return s
}

// keptOnDisk is what the kept files of cc's first process take on their
// file system (they are sparse where blocks were left out).
func keptOnDisk(t *testing.T, cc *Checkpoint) int64 {
	var n int64
	for _, k := range keptPaths(cc, 0) {
		var st syscall.Stat_t
		if err := syscall.Stat(k, &st); err != nil {
			t.Fatal(err)
		}
		n += st.Blocks * 512
	}
	return n
}

// checkpoint moves tg's memory out as the checkpoint name of d and
// commits it; it returns the checkpoint, and what its kept files took.
func (d *dedupStores) checkpoint(t *testing.T, tg *vramtest.Target, name string) (*Checkpoint, int64) {
	t.Helper()
	ctx := context.Background()
	st := vramtest.NewStore()
	cc, err := moveOut(ctx, []int{tg.PID}, st.Put, d.opts(t, tg, name))
	if err != nil {
		t.Fatal(err)
	}
	disk := keptOnDisk(t, cc)
	if err := cc.fast.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if err := cc.fast.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	cc.FastCommit()
	d.mu.Lock()
	d.byName[name] = st
	d.mu.Unlock()
	return cc, disk
}

// restore refills tg from the checkpoint name (as a restore does after
// the driver's) and checks its memory.
func (d *dedupStores) restore(t *testing.T, tg *vramtest.Target, name string, files []string) {
	t.Helper()
	if _, err := vram.FastResume(context.Background(), tg.SockDir, tg.PID, files, d.byName[name].Get, nil, nil); err != nil {
		t.Fatal(err)
	}
	tg.MustBeIntact(t)
}

// TestFastDedupKeepsChanged: the first --dedup checkpoint of a process
// keeps everything it wrote and records its block hashes; after one
// allocation is rewritten, the second copies out and keeps exactly that
// allocation's blocks (and the kernel's counter's), its kept files take
// no more on disk, its VRAM files are whole (it restores byte-exact,
// fresh device memory poisoned) and record the same hashes where nothing
// changed.
func TestFastDedupKeepsChanged(t *testing.T) {
	tg := vramtest.Start(t, "FP_EXTRA_MB=8", "GPUCR_FAKE_POISON=1")
	d := newDedupStores()
	one, _ := d.checkpoint(t, tg, "one")
	p1 := one.fast.Procs()[0]
	if n := d.noted(); p1.Reused != 0 || p1.Copy.Bytes != p1.Bytes || !strings.Contains(n, "went into no checkpoint") {
		t.Fatalf("first checkpoint: %+v, notes %q", p1, n)
	}
	h1, err := vram.ParseBlockHashes(d.byName["one"].Files[p1.Hashes])
	if err != nil || h1.Bytes() != p1.Bytes {
		t.Fatalf("block hashes of %s: %v, %d bytes for %d stored", p1.Hashes, err, h1.Bytes(), p1.Bytes)
	}
	d.restore(t, tg, "one", p1.Files)

	r := tg.Rewrite(t, "pitch")
	two, disk := d.checkpoint(t, tg, "two")
	p2 := two.fast.Procs()[0]
	changed := (int64(r.Size) + vramtest.ZBlock - 1) / vramtest.ZBlock * vramtest.ZBlock
	if p2.Copy.Bytes != changed && p2.Copy.Bytes != changed+vramtest.ZBlock { // the counter's block, if it moved
		t.Fatalf("second checkpoint copied %d bytes, want the rewritten allocation's %d (and the counter's block): %+v", p2.Copy.Bytes, changed, p2)
	}
	if p2.Bytes != p1.Bytes || p2.Reused != p2.Bytes-p2.Copy.Bytes || p2.Copy.Earlier != p2.Reused || p2.Earlier != "mem/one" {
		t.Fatalf("second checkpoint: %+v, want %d bytes in its files, the rest of the copied taken from mem/one", p2, p1.Bytes)
	}
	if n := d.noted(); n != "" {
		t.Fatalf("notes: %q", n)
	}
	// The files are those a whole copy makes: laid out as the first's,
	// different only in what changed.
	var pieces, differ int64
	for _, f := range p2.Files {
		a, b := d.byName["one"].Files[f], d.byName["two"].Files[f]
		st, err := vram.ReadFileStats(bytes.NewReader(b), int64(len(b)))
		if err != nil || len(a) != len(b) {
			t.Fatalf("%s: %v, %d bytes, the first's %d", f, err, len(b), len(a))
		}
		pieces += int64(st.Pieces)
		for i := range a {
			if a[i] != b[i] {
				differ++
			}
		}
	}
	if differ == 0 || differ > p2.Copy.Bytes {
		t.Fatalf("%d bytes of the files differ from the first's, %d were copied", differ, p2.Copy.Bytes)
	}
	if disk > p2.Copy.Bytes+(pieces+int64(len(p2.Files)))*4096 {
		t.Fatalf("the kept files take %d bytes, for %d copied", disk, p2.Copy.Bytes)
	}
	t.Logf("second checkpoint: %d bytes in its files, %d copied and kept (%d on disk), %d from mem/one; %d bytes of the files differ from the first's",
		p2.Bytes, p2.Copy.Bytes, disk, p2.Reused, differ)
	h2, err := vram.ParseBlockHashes(d.byName["two"].Files[p2.Hashes])
	if err != nil || h2.Bytes() != p2.Bytes {
		t.Fatalf("block hashes of the second: %v", err)
	}
	d.restore(t, tg, "two", p2.Files)
}

// TestFastDedupFallbacks: a process is copied whole, and says why, when
// no earlier checkpoint can be used: none recorded (the first, in
// TestFastDedupKeepsChanged), one removed, one none of whose blocks is
// as the memory is now; block hashes that do not parse fail the
// checkpoint before the release; the copy still restores.
func TestFastDedupFallbacks(t *testing.T) {
	ctx := context.Background()
	tg := vramtest.Start(t, "FP_EXTRA_MB=2")
	d := newDedupStores()
	one, _ := d.checkpoint(t, tg, "one")
	d.restore(t, tg, "one", one.fast.Procs()[0].Files)
	d.noted()
	saved := d.byName["one"]
	for _, tc := range []struct {
		name, want string
		change     func()
		fails      bool
	}{
		{"removed", "mem/one is gone", func() { delete(d.byName, "one") }, false},
		{"nothing unchanged", "none of its blocks is as mem/one holds it", func() {
			d.byName["one"] = saved
			for _, r := range tg.Regions {
				tg.Rewrite(t, r.Name)
			}
		}, false},
		{"damaged block hashes", "block hashes", func() {
			h := fmt.Sprintf("vram-%d.hashes", tg.PID)
			saved.Files[h] = saved.Files[h][:len(saved.Files[h])-1]
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.change()
			cc, err := moveOut(ctx, []int{tg.PID}, vramtest.NewStore().Put, d.opts(t, tg, "two"))
			if tc.fails {
				if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, errdefs.ErrCorrupt) {
					t.Fatalf("with %s: %v", tc.name, err)
				}
				tg.MustBeIntact(t)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if p := cc.fast.Procs()[0]; p.Reused != 0 || p.Copy.Bytes != p.Bytes {
				t.Fatalf("%+v, want a whole copy", p)
			}
			if n := d.noted(); !strings.Contains(n, tc.want) || !strings.Contains(n, "the kept copy holds all") {
				t.Fatalf("notes %q, want %q", n, tc.want)
			}
			if err := undoAll(cc); err != nil {
				t.Fatal(err)
			}
			tg.MustBeIntact(t)
		})
	}
}

// TestFastDedupUndo: a failure after the release (the store) refills the
// memory from the kept copy and the earlier checkpoint, byte-exact (fresh
// device memory poisoned). An earlier checkpoint whose bytes read back
// wrong (from the start, or from the store on) is caught where they are
// read: the store fails (these puts take bytes, so it reads them), and
// the undo never refills from it: the process stays parked, its kept
// copy stays, and `gpu resume --pid` refills it once it reads right.
func TestFastDedupUndo(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name     string
		fail     int64 // the store fails after that many bytes (-1: never)
		spoil    bool  // the earlier checkpoint reads wrong from the store on
		damaged  bool  // it reads wrong from the start
		stranded bool
	}{
		{name: "store fails", fail: 4096},
		{name: "earlier damaged", fail: -1, damaged: true, stranded: true},
		{name: "earlier spoiled after the copy out", fail: -1, spoil: true, stranded: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tg := vramtest.Start(t, "FP_EXTRA_MB=8", "GPUCR_FAKE_POISON=1")
			used := tg.Report(t).DeviceUsed
			d := newDedupStores()
			one, _ := d.checkpoint(t, tg, "one")
			d.restore(t, tg, "one", one.fast.Procs()[0].Files)
			tg.Rewrite(t, "vmm")
			d.spoil.Store(tc.damaged)
			st := vramtest.NewStore()
			st.FailAfter = tc.fail
			put := func(ctx context.Context, name string, r io.Reader) error {
				d.spoil.Store(tc.spoil || tc.damaged)
				return st.Put(ctx, name, r)
			}
			o := d.opts(t, tg, "two")
			cc, err := moveOut(ctx, []int{tg.PID}, put, o)
			if err != nil {
				t.Fatal(err)
			}
			if p := cc.fast.Procs()[0]; p.Reused == 0 {
				t.Fatalf("nothing left out: %+v", p)
			}
			if err := cc.fast.Wait(ctx); err == nil || tc.stranded && (!errors.Is(err, errdefs.ErrCorrupt) || !strings.Contains(err.Error(), "not what its record says")) {
				t.Fatalf("the store: %v", err)
			}
			err = undoAll(cc)
			if !tc.stranded {
				if err != nil {
					t.Fatal(err)
				}
				tg.MustBeIntact(t)
				if r := tg.Report(t); r.Parked || r.Released || r.DeviceUsed != used {
					t.Fatalf("after the undo: %+v", r)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), "stays parked") || !errors.Is(err, errdefs.ErrCorrupt) {
				t.Fatalf("undo from a spoiled earlier checkpoint: %v", err)
			}
			if r := tg.Check(t, 200*time.Millisecond); r != "" {
				t.Fatalf("the target ran after a refill that failed: %q", r)
			}
			if r := tg.Report(t); !r.Parked || !(r.Released || r.Unfilled) {
				t.Fatalf("report: %+v", r)
			}
			d.spoil.Store(false)
			done, err := vram.FastRecover(ctx, tg.SockDir, o.Records, []int{tg.PID}, d.open)
			if err != nil || len(done) != 1 {
				t.Fatalf("gpu resume --pid: %v %v", done, err)
			}
			tg.MustBeIntact(t)
			if ents, _ := os.ReadDir(o.KeepDir); len(ents) != 0 {
				t.Fatalf("kept copy left behind: %d files", len(ents))
			}
		})
	}
}

// TestFastDedupOrphaned: gpucr-stream dies after the release of a copy
// that left blocks out: the library cannot refill from it alone, so it
// waits, parked, and says to run `gpu resume --pid`, which refills it from
// the kept copy and the earlier checkpoint.
func TestFastDedupOrphaned(t *testing.T) {
	ctx := context.Background()
	tg := vramtest.Start(t, "FP_EXTRA_MB=8", "GPUCR_FAKE_POISON=1")
	d := newDedupStores()
	one, _ := d.checkpoint(t, tg, "one")
	d.restore(t, tg, "one", one.fast.Procs()[0].Files)
	st := vramtest.NewStore()
	st.Block = make(chan struct{})
	o := d.opts(t, tg, "two")
	cc, err := moveOut(ctx, []int{tg.PID}, st.Put, o)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		close(st.Block)
		_ = cc.fast.Wait(ctx)
	}()
	cc.fast.HangUp(ctx)
	var said []byte
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end) && len(said) == 0; time.Sleep(5 * time.Millisecond) {
		said, _ = os.ReadFile(preloadctl.StatusFile(tg.SockDir, tg.PID))
	}
	if !strings.HasPrefix(string(said), "waiting:") || !strings.Contains(string(said), "changed since an earlier checkpoint") {
		t.Fatalf("status: %q", said)
	}
	if r := tg.Check(t, 200*time.Millisecond); r != "" {
		t.Fatalf("the target ran: %q", r)
	}
	if _, err := vram.FastRecover(ctx, tg.SockDir, o.Records, []int{tg.PID}, nil); err == nil {
		t.Fatal("recovered without the earlier checkpoint")
	}
	done, err := vram.FastRecover(ctx, tg.SockDir, o.Records, []int{tg.PID}, d.open)
	if err != nil || len(done) != 1 {
		t.Fatalf("gpu resume --pid: %v %v", done, err)
	}
	tg.MustBeIntact(t)
}
