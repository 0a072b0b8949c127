package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/miniotest"
	"github.com/gpucr/gpucr-stream/store/s3"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/testwait"
)

// writeArchive captures a few synthetic image files into st.
func writeArchive(t *testing.T, st store.Store, host string, size int) {
	t.Helper()
	ctx := context.Background()
	out, err := streamer.NewArchiveOutput(ctx, st, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: 256 << 10, Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("gpucr-stream ls test page "), size/26+1)[:size]
	for _, n := range []string{"pages-1.img", "pagemap-1.img", "inventory.img"} {
		if _, err := c.WriteFile(n, bytes.NewReader(data), false); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Close(ctx, manifest.Manifest{Host: host}); err != nil {
		t.Fatal(err)
	}
}

// writeUnfinished leaves segments without a manifest, as a capture that
// was killed does.
func writeUnfinished(t *testing.T, st store.Store) {
	t.Helper()
	ctx := context.Background()
	for i := range 2 {
		w, err := st.Create(ctx, manifest.SegmentName(0xdead, i))
		if err != nil {
			t.Fatal(err)
		}
		w.Write(bytes.Repeat([]byte{byte(i)}, 1000))
		if err := w.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

func runCmd(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := run(context.Background(), args, strings.NewReader(""), &out, &errOut)
	if err != nil {
		errOut.WriteString(err.Error())
	}
	return out.String(), errOut.String(), exitCode(err, false)
}

type lsJSON struct {
	Name        string  `json:"name"`
	Location    string  `json:"location"`
	Host        string  `json:"host"`
	RawBytes    int64   `json:"raw_bytes"`
	StoredBytes int64   `json:"stored_bytes"`
	Ratio       float64 `json:"ratio"`
	Files       int     `json:"files"`
}

func lsNames(t *testing.T, where string) map[string]lsJSON {
	t.Helper()
	out, errOut, code := runCmd(t, "ls", "--json", where)
	if code != 0 {
		t.Fatalf("ls %s: exit %d: %s", where, code, errOut)
	}
	var items []lsJSON
	if err := json.Unmarshal([]byte(out), &items); err != nil {
		t.Fatalf("ls --json: %v: %s", err, out)
	}
	m := map[string]lsJSON{}
	for _, it := range items {
		m[it.Name] = it
	}
	return m
}

// lsRmGc runs the same story against a local directory and S3: two
// complete checkpoints and an unfinished one; ls lists the two, rm removes
// one manifest first, gc removes the unfinished one once old enough.
func lsRmGc(t *testing.T, root string, st store.Store) {
	writeArchive(t, store.Sub(st, "a/job1"), "node1", 300_000)
	writeArchive(t, store.Sub(st, "b/job2"), "node2", 100_000)
	writeUnfinished(t, store.Sub(st, "a/dead"))

	items := lsNames(t, root)
	if len(items) != 2 {
		t.Fatalf("ls lists %v, want a/job1 and b/job2", items)
	}
	j1 := items["a/job1"]
	if j1.Host != "node1" || j1.RawBytes != 900_000 || j1.StoredBytes <= 0 || j1.Ratio < 2 || j1.Files != 3 ||
		j1.Location != strings.TrimRight(root, "/")+"/a/job1" {
		t.Fatalf("ls entry %+v", j1)
	}
	out, errOut, code := runCmd(t, "ls", root)
	if code != 0 || !strings.Contains(out, "a/job1") || !strings.Contains(out, "node2") || strings.Contains(out, "dead") {
		t.Fatalf("ls text (exit %d):\n%s\nstderr: %s", code, out, errOut)
	}
	if items := lsNames(t, strings.TrimRight(root, "/")+"/a"); len(items) != 1 || items["job1"].Name != "job1" {
		t.Fatalf("ls of a sub-prefix: %v", items)
	}
	// The location itself a checkpoint.
	if items := lsNames(t, strings.TrimRight(root, "/")+"/b/job2"); len(items) != 1 {
		t.Fatalf("ls of a checkpoint: %v", items)
	}

	// rm refuses what is not a complete checkpoint.
	if _, errOut, code := runCmd(t, "rm", strings.TrimRight(root, "/")+"/a/dead"); code != exitNotFound || !strings.Contains(errOut, "gc") {
		t.Fatalf("rm of an unfinished checkpoint: exit %d: %s", code, errOut)
	}
	if out, _, code := runCmd(t, "rm", "--dry-run", strings.TrimRight(root, "/")+"/a/job1"); code != 0 || !strings.Contains(out, "would remove") {
		t.Fatalf("rm --dry-run: %d %s", code, out)
	}
	if len(lsNames(t, root)) != 2 {
		t.Fatal("rm --dry-run removed something")
	}
	if out, errOut, code := runCmd(t, "rm", strings.TrimRight(root, "/")+"/a/job1"); code != 0 {
		t.Fatalf("rm: exit %d: %s %s", code, out, errOut)
	}
	if items := lsNames(t, root); len(items) != 1 || items["b/job2"].Name == "" {
		t.Fatalf("ls after rm: %v", items)
	}
	ctx := context.Background()
	if objs, _ := st.List(ctx, "a/job1/"); len(objs) != 0 {
		t.Fatalf("rm left %v", objs)
	}

	// gc: the unfinished one is recent, so kept by default; removed when
	// older than the given age.
	if out, errOut, code := runCmd(t, "gc", root); code != 0 || !strings.Contains(out, "removed 0 unfinished") ||
		!strings.Contains(out, "leaves 1 unfinished checkpoint(s) younger than --older-than 1h") || !strings.Contains(out, "--older-than 0s") {
		t.Fatalf("gc (1h): exit %d: %s %s; want it to say why it kept the unfinished one, and how not to", code, out, errOut)
	}
	if objs, _ := st.List(ctx, "a/dead/"); len(objs) != 2 {
		t.Fatalf("gc removed a recent unfinished checkpoint: %v", objs)
	}
	time.Sleep(10 * time.Millisecond)
	// A dry run names every object it would remove.
	dead, _ := st.List(ctx, "a/dead/")
	out, _, code = runCmd(t, "gc", "--older-than", "1ms", "--dry-run", root)
	for _, o := range dead {
		if code != 0 || !strings.Contains(out, "would remove "+o.Name+"\n") {
			t.Fatalf("gc --dry-run does not name %s: %s", o.Name, out)
		}
	}
	out, errOut, code = runCmd(t, "gc", "--older-than", "1ms", "--json", root)
	if code != 0 {
		t.Fatalf("gc: exit %d: %s", code, errOut)
	}
	var res gcResult
	if err := json.Unmarshal([]byte(out), &res); err != nil || len(res.Unfinished) != 1 || res.Objects != 2 {
		t.Fatalf("gc --json: %v: %s", err, out)
	}
	if objs, _ := st.List(ctx, "a/"); len(objs) != 0 {
		t.Fatalf("gc left %v", objs)
	}
	if items := lsNames(t, root); len(items) != 1 {
		t.Fatalf("gc touched a complete checkpoint: %v", items)
	}
	if _, _, code := runCmd(t, "gc", "--older-than", "soon", root); code != exitUsage {
		t.Fatalf("gc --older-than soon: exit %d", code)
	}
}

func TestLsRmGcDir(t *testing.T) {
	root := t.TempDir()
	lsRmGc(t, root, dir.New(root))
	// The directories of the removed checkpoints are gone too.
	if _, err := os.Stat(filepath.Join(root, "a", "job1")); !os.IsNotExist(err) {
		t.Fatalf("rm left the checkpoint's directory: %v", err)
	}
	// A killed writer's temporary file is removed by gc once old.
	tmp := filepath.Join(root, "b", "job2", "segments", ".00000009.gcs.tmp-123")
	if err := os.WriteFile(tmp, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-2 * time.Hour)
	os.Chtimes(tmp, old, old)
	if out, _, code := runCmd(t, "gc", root); code != 0 || !strings.Contains(out, "1 temporary file") {
		t.Fatalf("gc: %s", out)
	}
	if _, err := os.Stat(tmp); !os.IsNotExist(err) {
		t.Fatal("gc kept an old temporary file")
	}
	if _, errOut, code := runCmd(t, "ls", filepath.Join(root, "nonexistent")); code != exitNotFound {
		t.Fatalf("ls of a missing directory: exit %d: %s", code, errOut)
	}

	// gc of a directory of the user's own is refused, and touches nothing
	// there: not its old empty directories, not a file named like a
	// temporary one.
	home := t.TempDir()
	for _, p := range []string{"photos/2019", "src/empty"} {
		if err := os.MkdirAll(filepath.Join(home, p), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(home, ".notes.txt.tmp-1"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"photos/2019", "photos", "src/empty", "src", ".notes.txt.tmp-1"} {
		os.Chtimes(filepath.Join(home, p), old, old)
	}
	for _, args := range [][]string{{"gc", home}, {"gc", "--dry-run", home}, {"gc", "--older-than", "0s", home}} {
		if _, errOut, code := runCmd(t, args...); code != exitNotFound || !strings.Contains(errOut, "no checkpoint, segment or chunk store") {
			t.Fatalf("%q: exit %d: %s", args, code, errOut)
		}
	}
	for _, p := range []string{"photos/2019", "src/empty", ".notes.txt.tmp-1"} {
		if _, err := os.Stat(filepath.Join(home, p)); err != nil {
			t.Errorf("gc of the user's directory removed %s", p)
		}
	}
}

func TestLsRmGcS3(t *testing.T) {
	srv := miniotest.Start(t)
	srv.MakeBucket(t, "lsgc")
	for _, k := range []string{"AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3"} {
		t.Setenv(k, "")
	}
	t.Setenv("AWS_ENDPOINT_URL", srv.Endpoint())
	t.Setenv("AWS_ACCESS_KEY_ID", srv.AccessKey())
	t.Setenv("AWS_SECRET_ACCESS_KEY", srv.SecretKey())
	ctx := context.Background()
	st, err := s3.New(ctx, s3.Config{Bucket: "lsgc", Prefix: "fleet", PartSize: 5 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	lsRmGc(t, "s3://lsgc/fleet/", st)

	// A writer that died in the middle of a multipart upload leaves an
	// upload no listing shows; gc aborts it once old enough.
	w, err := st.Create(ctx, "c/dead/"+manifest.SegmentName(0xdead, 0))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(make([]byte, 6<<20)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(testwait.Scale(500 * time.Millisecond)) // the first part goes up
	out, errOut, code := runCmd(t, "gc", "--older-than", "1ms", "--json", "s3://lsgc/fleet")
	var res gcResult
	if code != 0 || json.Unmarshal([]byte(out), &res) != nil || res.Uploads != 1 {
		t.Fatalf("gc of an incomplete upload: exit %d: %s %s", code, out, errOut)
	}
	w.Abort(ctx)
	if _, errOut, code := runCmd(t, "ls", "s3://no-such-bucket/x"); code != exitNotFound || !strings.Contains(errOut, "ls: s3://no-such-bucket: no such bucket at ") {
		t.Fatalf("ls of a missing bucket: exit %d: %s", code, errOut)
	}
	t.Setenv("AWS_SECRET_ACCESS_KEY", "wrong")
	if _, errOut, code := runCmd(t, "ls", "s3://lsgc/fleet"); code != exitFailure || !strings.Contains(errOut, "credentials refused") {
		t.Fatalf("ls with a wrong secret: exit %d: %s", code, errOut)
	}
}

// TestGcAfterRmSaysWhy: gc right after rm of a deduplicated checkpoint
// frees nothing, since the packs only it used are younger than
// --older-than; it says so and how to take them now, which then works.
func TestGcAfterRmSaysWhy(t *testing.T) {
	root := t.TempDir()
	ctx := context.Background()
	loc := dir.New(root)
	out, err := streamer.NewDedupOutput(ctx, store.Sub(loc, "job"), loc, 1<<20, nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: 256 << 10, Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.WriteFile("pages-1.img", bytes.NewReader(bytes.Repeat([]byte("gc after rm "), 200_000)), false); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		t.Fatal(err)
	}
	if _, errOut, code := runCmd(t, "rm", filepath.Join(root, "job")); code != 0 {
		t.Fatalf("rm: exit %d: %s", code, errOut)
	}
	gc, errOut, code := runCmd(t, "gc", root)
	if code != 0 || !strings.Contains(gc, "removed 0 unreferenced pack(s)") ||
		!strings.Contains(gc, "leaves 1 unreferenced pack(s)") || !strings.Contains(gc, "younger than --older-than 1h") ||
		!strings.Contains(gc, "gpucr-stream gc --older-than 0s "+root) {
		t.Fatalf("gc after rm: exit %d:\n%s%s\nwant it to say it kept the packs for their age, and how not to", code, gc, errOut)
	}
	t.Logf("gc after rm:\n%s", gc)
	gc, errOut, code = runCmd(t, "gc", "--older-than", "0s", root)
	if code != 0 || !strings.Contains(gc, "removed 1 unreferenced pack(s)") || strings.Contains(gc, "leaves") {
		t.Fatalf("gc --older-than 0s: exit %d:\n%s%s", code, gc, errOut)
	}
}
