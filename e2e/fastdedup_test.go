package e2e

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
)

// TestFastPathDedup: `checkpoint --dedup` of a fast-path process (fake
// driver, real CRIU). The VRAM files are laid out by device address, so a
// second checkpoint of the unchanged process finds its device memory in the
// location's chunk store (only the kernel's counter is new), and after the
// program rewrote one allocation only that one's bytes are new; the last
// checkpoint restores, and the program proves its memory, the rewritten
// allocation with its new pattern. Issue 36: every checkpoint after the
// first copies out and keeps only the blocks that changed since the one
// before (the kernel's counter's; the rewritten allocation's), and the
// rest is read back from that one: the resume after --leave-running, the
// undo of a checkpoint whose store fails after the release, the store.
func TestFastPathDedup(t *testing.T) {
	e := setupFast(t)
	ctx := testCtx(t)
	// 64 MiB more device memory (e.env passes it on): the target's few
	// MiB alone are about one chunk's worth around each change.
	t.Setenv("FP_EXTRA_MB", "64")
	pid, tdir, waitGone := e.start(t, "t")
	loc := filepath.Join(e.dir, "loc")
	kept := map[string]vramSummary{}
	args := func(name string, extra ...string) []string {
		return append([]string{"checkpoint", "--dedup", "--pid", strconv.Itoa(pid), "--to", filepath.Join(loc, name),
			"--work-dir", filepath.Join(e.dir, "w-"+name), "--criu", e.criu, "--json", "--no-progress", "--vram-files", "3"}, extra...)
	}
	ck := func(name string, extra ...string) *manifest.Manifest {
		t.Helper()
		out, err := e.gcsRun(ctx, args(name, extra...)...)
		if err != nil {
			t.Fatal(err)
		}
		var ph phases
		var res struct {
			VRAM vramSummary `json:"vram"`
		}
		if err := json.Unmarshal(out, &ph); err != nil || !ph.has("vram copy out") || json.Unmarshal(out, &res) != nil {
			t.Fatalf("checkpoint %s took no fast path: %s (%v)", name, out, err)
		}
		kept[name] = res.VRAM
		m := archiveManifest(t, filepath.Join(loc, name))
		if m.Format != 4 || len(m.CUDA) != 1 || m.CUDA[0].Path != manifest.CUDAPathPreload || len(m.CUDA[0].Files) != 3 || m.CUDA[0].Hashes == "" {
			t.Fatalf("checkpoint %s: format %d, cuda %+v", name, m.Format, m.CUDA)
		}
		return m
	}
	intact := func(when string) {
		t.Helper()
		if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
			t.Fatalf("%s: %q", when, r)
		}
	}
	intact("before")
	one := ck("one", "--leave-running")
	intact("after the first checkpoint")
	two := ck("two", "--leave-running")
	intact("after the second checkpoint")

	pitch := rewritePitched(t, tdir)
	intact("after the rewrite")
	// A checkpoint whose store fails after the release: CRIU resumes the
	// process, whose memory comes back from the kept copy (the pitched
	// allocation, the counter) and "two".
	if out, _, err := e.runBin(ctx, HooksBinary(t), []string{"GPUCR_TEST_FAULT=store"}, args("failed")...); err == nil || !strings.Contains(string(out)+err.Error(), "injected store failure") {
		t.Fatalf("a checkpoint whose store fails: %v %s", err, out)
	}
	intact("after the failed checkpoint's undo")
	three := ck("three")
	waitGone()
	// Each after the first kept what changed since the one before: the
	// counter's block; the pitched allocation's blocks too.
	for name, most := range map[string]int64{"two": 2 * zblock, "three": (pitch+zblock-1)/zblock*zblock + 2*zblock} {
		if v := kept[name]; v.Kept > most || v.Reused == 0 || v.Reused+v.Kept != v.Stored || v.Earlier == "" {
			t.Errorf("checkpoint %s kept %+v, want at most %d bytes kept, the rest from the one before", name, v, most)
		}
	}
	t.Logf("kept: one %+v, two %+v, three %+v", kept["one"], kept["two"], kept["three"])

	// What each checkpoint's VRAM files hold that the one before did not.
	vramStored, newTwo := vramNew(one, two)
	_, newThree := vramNew(two, three)
	out, err := e.gcsRun(ctx, "ls", "--json", loc)
	if err != nil {
		t.Fatal(err)
	}
	es := lsEntries(t, gcsResult{stdout: string(out)})
	t.Logf("VRAM %d stored bytes; new in the second checkpoint %d, in the third (%d bytes rewritten) %d; new bytes in the location: %d, %d, %d",
		vramStored, newTwo, pitch, newThree, es["one"].NewBytes, es["two"].NewBytes, es["three"].NewBytes)
	// The counter's page is in one chunk; the rewritten allocation
	// (random bytes: stored as they are) in a few, with their neighbours.
	if float64(newTwo) > 0.02*float64(vramStored) {
		t.Errorf("unchanged device memory: %d of %d stored VRAM bytes new in the second checkpoint, want at most 2%% (the counter's chunk)", newTwo, vramStored)
	}
	if newThree < pitch || float64(newThree) > float64(pitch)+0.02*float64(vramStored) {
		t.Errorf("one allocation of %d bytes rewritten: %d VRAM bytes new, want at least it and at most 2%% of %d more", pitch, newThree, vramStored)
	}
	if !es["two"].Dedup || float64(es["two"].NewBytes) > unchangedShare*float64(es["one"].NewBytes) {
		t.Errorf("ls: the second checkpoint added %d bytes to the location, over %.0f%% of the first's %d (%+v)", es["two"].NewBytes, 100*unchangedShare, es["one"].NewBytes, es["two"])
	}

	out, err = e.gcsRunEnv(ctx, []string{"GPUCR_FILL=1"}, "restore", "--from", filepath.Join(loc, "three"), "--work-dir", filepath.Join(e.dir, "w-restore"), "--criu", e.criu, "--json", "--no-progress")
	mustRestoreFast(t, out, err, pid, tdir)
	// The filler read the deduplicated checkpoint's chunks too.
	var rs phases
	if err := json.Unmarshal(out, &rs); err != nil {
		t.Fatal(err)
	}
	mustAdoptFill(t, rs)
}

// rewritePitched has the fast-path target rewrite its pitched allocation
// with a new pattern, and returns its size.
func rewritePitched(t *testing.T, tdir string) int64 {
	t.Helper()
	regions, err := os.ReadFile(filepath.Join(tdir, "addrs"))
	if err != nil {
		t.Fatal(err)
	}
	var pitch int64
	for k, l := range strings.Split(strings.TrimSpace(string(regions)), "\n") {
		if f := strings.Fields(l); f[0] == "pitch" {
			pitch, _ = strconv.ParseInt(f[2], 10, 64)
			if err := os.WriteFile(filepath.Join(tdir, "rewrite.tmp"), []byte(strconv.Itoa(k)+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(filepath.Join(tdir, "rewrite.tmp"), filepath.Join(tdir, "rewrite")); err != nil {
				t.Fatal(err)
			}
		}
	}
	for end := time.Now().Add(5 * time.Second); !fileExists(filepath.Join(tdir, "rewritten")); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(end) || pitch == 0 {
			t.Fatalf("the target did not rewrite its pitched allocation (%d bytes)", pitch)
		}
	}
	return pitch
}

// vramNew returns the stored bytes of cur's VRAM files and how many of
// them are in chunks prev does not have (zero chunks cost nothing).
func vramNew(prev, cur *manifest.Manifest) (stored, fresh int64) {
	known := map[manifest.Hash]bool{}
	for _, f := range prev.Files {
		for _, c := range f.Chunks {
			known[c.Hash] = true
		}
	}
	for _, f := range cur.Files {
		if !slices.Contains(cur.CUDA[0].Files, f.Name) {
			continue
		}
		for _, c := range f.Chunks {
			stored += int64(c.Stored)
			if c.Codec != uint8(codec.Zero) && !known[c.Hash] {
				fresh += int64(c.Stored)
			}
		}
	}
	return stored, fresh
}

// vramSummary is a checkpoint's --json "vram" (gpuckpt.VRAMSummary).
type vramSummary struct {
	Allocated int64  `json:"allocated_bytes"`
	Stored    int64  `json:"stored_bytes"`
	Kept      int64  `json:"kept_bytes"`
	Reused    int64  `json:"earlier_bytes"`
	Earlier   string `json:"earlier"`
}

// zblock is the library's zero-scan block (vram/vramtest.ZBlock).
const zblock = 64 << 10
