package e2e

// A bad index object of a chunk store is survivable (issue 37, F8): one
// corrupt or truncated index object made every later --dedup capture into
// the location, and every gc, exit 3, and nothing repaired it.

import (
	"bytes"
	"context"
	"encoding/json"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/catalog"
	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/minio/minio-go/v7"
)

// syntheticImages are the files of a synthetic CRIU dump: pages of noise
// (seeded), and small images.
func syntheticImages(seed uint64, mb int) map[string][]byte {
	r := rand.New(rand.NewPCG(seed, 37))
	pages := make([]byte, mb<<20)
	for i := range pages {
		pages[i] = byte(r.Uint32())
	}
	return map[string][]byte{
		"pages-1.img":   pages,
		"core-1.img":    []byte(strings.Repeat("core ", 200)),
		"inventory.img": []byte("inventory"),
	}
}

// captureImages runs `capture --dedup --to dest` with the CRIU socket
// protocol driven by the project's own client, pushing files.
func captureImages(ctx context.Context, t *testing.T, dir, dest string, files map[string][]byte) gcsResult {
	t.Helper()
	images, err := os.MkdirTemp(dir, "img")
	if err != nil {
		t.Fatal(err)
	}
	var stdout bytes.Buffer
	p := startGCS(ctx, t, gcsOpts{stdout: &stdout}, "--images-dir", images, "capture", "--dedup", "--to", dest, "--chunk-size", "256KiB")
	if !p.waitLine(ctx, "socket-init") {
		code := p.exitCode(ctx)
		return gcsResult{stdout: stdout.String(), stderr: p.stderr.String(), code: code}
	}
	cl, err := criusock.Dial(ctx, images)
	if err != nil {
		t.Fatal(err)
	}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if err := cl.Push(ctx, n, bytes.NewReader(files[n])); err != nil {
			t.Fatalf("push %s: %v (capture: %s)", n, err, p.stderr.String())
		}
	}
	cl.Close()
	code := p.exitCode(ctx)
	t.Logf("capture --dedup --to %s: exit %d", dest, code)
	return gcsResult{stdout: stdout.String(), stderr: p.stderr.String(), code: code}
}

// objectStore is how a test reaches a location's objects behind
// gpucr-stream's back, to damage them.
type objectStore struct {
	url    string                    // the location, as gpucr-stream takes it
	list   func(dir string) []string // object names under dir ("gpucr-chunks/index/"), sorted
	get    func(name string) []byte
	put    func(name string, b []byte)
	remove func(name string)
}

func dirObjects(t *testing.T, loc string) objectStore {
	return objectStore{
		url: loc,
		list: func(dir string) []string {
			m, _ := filepath.Glob(filepath.Join(loc, dir, "*"))
			for i := range m {
				m[i] = strings.TrimPrefix(m[i], loc+"/")
			}
			sort.Strings(m)
			return m
		},
		get: func(name string) []byte {
			b, err := os.ReadFile(filepath.Join(loc, name))
			if err != nil {
				t.Fatal(err)
			}
			return b
		},
		put: func(name string, b []byte) {
			if err := os.WriteFile(filepath.Join(loc, name), b, 0o644); err != nil {
				t.Fatal(err)
			}
		},
		remove: func(name string) {
			if err := os.Remove(filepath.Join(loc, name)); err != nil {
				t.Fatal(err)
			}
		},
	}
}

func s3Objects(ctx context.Context, t *testing.T, e *s3Env, prefix string) objectStore {
	cl := e.srv.Client(t)
	return objectStore{
		url: e.url(prefix),
		list: func(dir string) []string {
			var out []string
			for _, k := range e.keys(ctx, t, prefix+"/"+dir) {
				out = append(out, strings.TrimPrefix(k, prefix+"/"))
			}
			sort.Strings(out)
			return out
		},
		get: func(name string) []byte {
			o, err := cl.GetObject(ctx, s3Bucket, prefix+"/"+name, minio.GetObjectOptions{})
			if err != nil {
				t.Fatal(err)
			}
			defer o.Close()
			var b bytes.Buffer
			if _, err := b.ReadFrom(o); err != nil {
				t.Fatal(err)
			}
			return b.Bytes()
		},
		put: func(name string, b []byte) {
			if _, err := cl.PutObject(ctx, s3Bucket, prefix+"/"+name, bytes.NewReader(b), int64(len(b)), minio.PutObjectOptions{}); err != nil {
				t.Fatal(err)
			}
		},
		remove: func(name string) {
			if err := cl.RemoveObject(ctx, s3Bucket, prefix+"/"+name, minio.RemoveObjectOptions{}); err != nil {
				t.Fatal(err)
			}
		},
	}
}

func TestBadIndexSurvivableDir(t *testing.T) {
	CRIU(t)
	dir := ShortTempDir(t)
	badIndexSurvivable(t, dir, dirObjects(t, filepath.Join(dir, "loc")))
}

func TestBadIndexSurvivableS3(t *testing.T) {
	e := startS3(t)
	badIndexSurvivable(t, ShortTempDir(t), s3Objects(testCtx(t), t, e, "fleet"))
}

// checkReport runs check --json with args on loc and returns its exit
// code and report.
func checkReport(ctx context.Context, t *testing.T, loc string, args ...string) (int, catalog.CheckReport) {
	t.Helper()
	r := gcsRun(ctx, t, append(append([]string{"check", "--json"}, args...), loc)...)
	var rep catalog.CheckReport
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil {
		t.Fatalf("check --json %v: exit %d: %v\n%s\n%s", args, r.code, err, r.stdout, r.stderr)
	}
	return r.code, rep
}

// badIndexSurvivable: a --dedup capture into a location whose index
// object is corrupt (a byte flipped) exits 0, warns naming the object and
// stores the chunks again; with that capture's index object truncated
// too, gc exits 0 and warns naming both; every checkpoint verifies. check
// reports the two objects (exit 3), --repair-index rebuilds the index, and
// a capture after it shares chunks again. Then a pack is deleted: check
// names exactly the checkpoints that no longer verify (not one, whose
// chunks two stored again).
func badIndexSurvivable(t *testing.T, dir string, loc objectStore) {
	ctx := testCtx(t)
	at := func(name string) string { return strings.TrimRight(loc.url, "/") + "/" + name }
	indexes := func() []string { return loc.list("gpucr-chunks/index/") }
	images := syntheticImages(1, 4)
	captureImages(ctx, t, dir, at("one"), images).ok(t, "capture one")
	idx := indexes()
	if len(idx) != 1 {
		t.Fatalf("index objects after one capture: %v", idx)
	}
	b := loc.get(idx[0])
	b[len(b)/2] ^= 0x40
	loc.put(idx[0], b)

	images["core-2.img"] = []byte("another thread")
	r := captureImages(ctx, t, dir, at("two"), images)
	if r.code != 0 || !strings.Contains(r.stderr, idx[0]) {
		t.Fatalf("capture into a location with a corrupt index object %s: exit %d, want 0 and a warning naming it\n%s", idx[0], r.code, r.stderr)
	}
	es := lsEntries(t, gcsRun(ctx, t, "ls", "--json", loc.url).ok(t, "ls"))
	if es["two"].NewBytes < es["one"].NewBytes {
		t.Errorf("the capture after the corrupt index object added %d bytes, the first %d: it shared chunks only that object listed", es["two"].NewBytes, es["one"].NewBytes)
	}
	both := indexes()
	if len(both) != 2 {
		t.Fatalf("index objects after two captures: %v", both)
	}
	truncated := both[0]
	if truncated == idx[0] {
		truncated = both[1]
	}
	b = loc.get(truncated)
	loc.put(truncated, b[:len(b)/2])

	r = gcsRun(ctx, t, "gc", "--older-than", "0s", loc.url)
	if r.code != 0 || !strings.Contains(r.stderr, idx[0]) || !strings.Contains(r.stderr, truncated) {
		t.Fatalf("gc of a location with a corrupt and a truncated index object: exit %d, want 0 and warnings naming %s and %s\n%s", r.code, idx[0], truncated, r.stderr)
	}
	for _, n := range []string{"one", "two"} {
		gcsRun(ctx, t, "verify", at(n)).ok(t, "verify "+n)
	}

	code, rep := checkReport(ctx, t, loc.url)
	if code != 3 || rep.OK || len(rep.BadIndex) != 2 || rep.Checkpoints != 2 || len(rep.Damaged) != 0 {
		t.Fatalf("check of a location with two bad index objects: exit %d, %+v", code, rep)
	}
	before := indexes() // gc may have written one, beside the bad ones
	code, rep = checkReport(ctx, t, loc.url, "--repair-index")
	if code != 0 || !rep.OK || rep.Repaired == nil || rep.Repaired.Removed != len(before) || !slices.Equal(indexes(), []string{rep.Repaired.Written}) {
		t.Fatalf("check --repair-index of %v: exit %d, %+v, then %v", before, code, rep, indexes())
	}
	code, rep = checkReport(ctx, t, loc.url, "--read-data")
	if code != 0 || !rep.OK || len(rep.BadIndex) != 0 || rep.Unindexed != 0 || rep.Verified != 2 {
		t.Fatalf("check --read-data after the repair: exit %d, %+v", code, rep)
	}
	captureImages(ctx, t, dir, at("three"), images).ok(t, "capture three")
	es = lsEntries(t, gcsRun(ctx, t, "ls", "--json", loc.url).ok(t, "ls"))
	t.Logf("new bytes: one %d, two %d, three (after the repair) %d", es["one"].NewBytes, es["two"].NewBytes, es["three"].NewBytes)
	if es["three"].NewBytes > es["one"].NewBytes/20 {
		t.Errorf("the capture after check --repair-index added %d bytes, the first %d: it shared nothing", es["three"].NewBytes, es["one"].NewBytes)
	}

	// The pack of the chunk only two has (three shares it) goes: check
	// names exactly the checkpoints verify then fails.
	var m struct {
		Segments []struct{ Name string } `json:"segments"`
		Files    []struct {
			Name   string
			Chunks []struct{ Seg int } `json:"chunks"`
		} `json:"files"`
	}
	if err := json.Unmarshal(loc.get("two/manifest.json"), &m); err != nil {
		t.Fatalf("two's manifest: %v", err)
	}
	gone := ""
	for _, f := range m.Files {
		if f.Name == "core-2.img" && len(f.Chunks) == 1 && f.Chunks[0].Seg < len(m.Segments) {
			gone = m.Segments[f.Chunks[0].Seg].Name
		}
	}
	if gone == "" {
		t.Fatalf("two's manifest has no chunk of core-2.img: %+v", m)
	}
	loc.remove(gone)
	var broken []string
	for _, n := range []string{"one", "two", "three"} {
		if gcsRun(ctx, t, "verify", at(n)).code != 0 {
			broken = append(broken, at(n))
		}
	}
	slices.Sort(broken)
	code, rep = checkReport(ctx, t, loc.url)
	var named []string
	for _, d := range rep.Damaged {
		named = append(named, d.Name)
	}
	t.Logf("damaged after %s went: %v", gone, rep.Damaged)
	if code != 3 || !slices.Contains(named, at("two")) || !slices.Equal(named, broken) {
		t.Fatalf("check after a pack went: exit %d, damaged %v; verify fails %v", code, named, broken)
	}
	r = gcsRun(ctx, t, "check", loc.url)
	if r.code != 3 || !strings.Contains(r.stdout, "damaged checkpoint "+at("two")) {
		t.Fatalf("check: exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
}
