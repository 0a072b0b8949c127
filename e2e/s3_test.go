package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store/miniotest"
)

// The S3 tests checkpoint the e2e target straight into a real MinIO server
// started by the test (store/miniotest: loopback, free port, random
// credentials, temporary data dir) and restore it from there. Without a
// minio binary they skip, except under CI=true, where they fail.

const s3Bucket = "ckpt"

// s3Env is a MinIO server with a bucket, and the environment that points
// gpucr-stream at it (the variables users set: AWS_ENDPOINT_URL,
// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY).
type s3Env struct {
	srv *miniotest.Server
}

func startS3(t *testing.T) *s3Env {
	t.Helper()
	return startS3With(t, miniotest.Options{})
}

// startS3With is startS3 with a MinIO that has features (a KMS, TLS).
func startS3With(t *testing.T, o miniotest.Options) *s3Env {
	t.Helper()
	CRIU(t)
	srv := miniotest.StartWith(t, o)
	srv.MakeBucket(t, s3Bucket)
	// Nothing of the developer's own AWS or gpucr settings may leak in.
	for _, k := range []string{"AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3",
		"GPUCR_S3_ENDPOINT", "GPUCR_S3_REGION", "GPUCR_S3_PATH_STYLE", "GPUCR_S3_PART_SIZE", "GPUCR_S3_PARALLEL",
		"GPUCR_SEGMENT_SIZE", "GPUCR_CODEC", "GPUCR_JSON", "GPUCR_TO", "GPUCR_FROM"} {
		t.Setenv(k, "")
		os.Unsetenv(k)
	}
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", filepath.Join(t.TempDir(), "no-credentials"))
	t.Setenv("AWS_CONFIG_FILE", filepath.Join(t.TempDir(), "no-config"))
	t.Setenv("AWS_ENDPOINT_URL", srv.Endpoint())
	t.Setenv("AWS_ACCESS_KEY_ID", srv.AccessKey())
	t.Setenv("AWS_SECRET_ACCESS_KEY", srv.SecretKey())
	return &s3Env{srv: srv}
}

func (e *s3Env) url(name string) string { return "s3://" + s3Bucket + "/" + name }

// keys lists the objects under prefix.
func (e *s3Env) keys(ctx context.Context, t testing.TB, prefix string) []string {
	t.Helper()
	var out []string
	for o := range e.srv.Client(t).ListObjects(ctx, s3Bucket, minio.ListObjectsOptions{Prefix: prefix, Recursive: true}) {
		if o.Err != nil {
			t.Fatalf("list %s: %v", prefix, o.Err)
		}
		out = append(out, o.Key)
	}
	return out
}

// uploads lists the unfinished multipart uploads under prefix.
func (e *s3Env) uploads(ctx context.Context, t testing.TB, prefix string) []string {
	t.Helper()
	var out []string
	for u := range e.srv.Client(t).ListIncompleteUploads(ctx, s3Bucket, "", true) {
		if u.Err != nil {
			t.Fatalf("list uploads: %v", u.Err)
		}
		if strings.HasPrefix(u.Key, prefix) {
			out = append(out, u.Key)
		}
	}
	return out
}

// gcsResult is a finished gpucr-stream run.
type gcsResult struct {
	stdout, stderr string
	code           int
}

// gcsRun runs gpucr-stream to its end.
func gcsRun(ctx context.Context, t testing.TB, args ...string) gcsResult {
	t.Helper()
	bin := BuildBinary(t, "./cmd/gpucr-stream")
	cmd := exec.CommandContext(ctx, bin, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("gpucr-stream %s: %v", strings.Join(args, " "), err)
	}
	r := gcsResult{stdout: stdout.String(), stderr: stderr.String(), code: cmd.ProcessState.ExitCode()}
	t.Logf("gpucr-stream %s: exit %d in %v", strings.Join(args, " "), r.code, time.Since(start).Round(time.Millisecond))
	return r
}

func (r gcsResult) ok(t testing.TB, what string) gcsResult {
	t.Helper()
	if r.code != 0 {
		t.Fatalf("%s: exit %d\nstdout: %s\nstderr: %s", what, r.code, r.stdout, r.stderr)
	}
	return r
}

type lsItem struct {
	Name        string    `json:"name"`
	Location    string    `json:"location"`
	Created     time.Time `json:"created"`
	Host        string    `json:"host"`
	Files       int       `json:"files"`
	Segments    int       `json:"segments"`
	RawBytes    int64     `json:"raw_bytes"`
	StoredBytes int64     `json:"stored_bytes"`
	Ratio       float64   `json:"ratio"`
	Error       string    `json:"error"`
}

// ls runs `gpucr-stream ls --json` and returns the checkpoints by name.
func ls(ctx context.Context, t testing.TB, where string) map[string]lsItem {
	t.Helper()
	r := gcsRun(ctx, t, "ls", "--json", where).ok(t, "ls "+where)
	var items []lsItem
	if err := json.Unmarshal([]byte(r.stdout), &items); err != nil {
		t.Fatalf("ls --json: %v: %s", err, r.stdout)
	}
	out := map[string]lsItem{}
	for _, it := range items {
		out[it.Name] = it
	}
	return out
}

func checkListed(t testing.TB, items map[string]lsItem, name string, minRaw int64) {
	t.Helper()
	it, ok := items[name]
	switch {
	case !ok:
		t.Fatalf("ls does not list %s: %+v", name, items)
	case it.Error != "":
		t.Fatalf("ls: %s: %s", name, it.Error)
	case it.RawBytes < minRaw || it.StoredBytes <= 0 || it.Ratio <= 0 || it.Host == "" || it.Created.IsZero() || it.Files < 10 || it.Segments < 1:
		t.Fatalf("ls entry of %s is incomplete: %+v", name, it)
	}
}

// noSecret fails if a run printed the secret key.
func noSecret(t testing.TB, r gcsResult, secrets ...string) {
	t.Helper()
	for _, s := range secrets {
		if s != "" && (strings.Contains(r.stdout, s) || strings.Contains(r.stderr, s)) {
			t.Fatalf("the secret key was printed:\nstdout: %s\nstderr: %s", r.stdout, r.stderr)
		}
	}
}

// TestS3CaptureServe: criu dump --stream into `capture --to s3://...`
// (criu run by the test), ls lists it, inspect and verify read it, serve
// --from s3:// feeds criu restore, and the target carries on intact; rm
// then removes it, manifest first.
func TestS3CaptureServe(t *testing.T) {
	e := startS3(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 128)
	url := e.url("team/job1")

	a := mkdir(t, filepath.Join(dir, "a"))
	capture := startGCS(ctx, t, gcsOpts{}, "--images-dir", a, "capture", "--to", url, "--segment-size", "32MiB")
	dumpThrough(ctx, t, tg, a, capture)
	checkStatsLine(t, capture.lines())

	items := ls(ctx, t, e.url("team"))
	checkListed(t, items, "job1", 100<<20)
	if it := items["job1"]; it.Segments < 3 || it.Location != url {
		t.Fatalf("ls: %+v: want several 32 MiB segments at %s", it, url)
	}
	text := gcsRun(ctx, t, "ls", e.url("team")).ok(t, "ls")
	if !strings.Contains(text.stdout, "job1") || !strings.Contains(text.stdout, "RATIO") {
		t.Fatalf("ls output:\n%s", text.stdout)
	}
	ins := gcsRun(ctx, t, "inspect", "--json", url).ok(t, "inspect")
	if !strings.Contains(ins.stdout, `"inventory.img"`) {
		t.Fatalf("inspect lists no inventory.img: %s", ins.stdout)
	}
	gcsRun(ctx, t, "verify", url).ok(t, "verify")
	x := mkdir(t, filepath.Join(dir, "x"))
	gcsRun(ctx, t, "--images-dir", x, "extract", "--from", url).ok(t, "extract")
	var extracted int64
	ents, _ := os.ReadDir(x)
	for _, e := range ents {
		if info, err := e.Info(); err == nil && strings.HasSuffix(e.Name(), ".img") {
			extracted += info.Size()
		}
	}
	if extracted != items["job1"].RawBytes || !fileExists(filepath.Join(x, "inventory.img")) {
		t.Fatalf("extract wrote %d bytes in %d files, the checkpoint holds %d", extracted, len(ents), items["job1"].RawBytes)
	}

	b := mkdir(t, filepath.Join(dir, "b"))
	serve := startGCS(ctx, t, gcsOpts{}, "--images-dir", b, "serve", "--from", url)
	if criuErr, serveErr := restoreThrough(ctx, t, b, serve); criuErr != nil || serveErr != nil {
		t.Fatalf("restore: criu: %v; serve: %v", criuErr, serveErr)
	}
	provenRestore(ctx, t, tg, before)

	rm := gcsRun(ctx, t, "rm", url).ok(t, "rm")
	noSecret(t, rm, e.srv.SecretKey())
	if keys := e.keys(ctx, t, "team/job1/"); len(keys) != 0 {
		t.Fatalf("rm left %v", keys)
	}
	if items := ls(ctx, t, e.url("team")); len(items) != 0 {
		t.Fatalf("ls after rm: %+v", items)
	}
	if r := gcsRun(ctx, t, "rm", url); r.code != 4 {
		t.Fatalf("rm of a removed checkpoint: exit %d, want 4: %s", r.code, r.stderr)
	}
}

// TestS3CheckpointRestore: `gpucr-stream checkpoint --pid` straight into
// S3 (committed before CRIU kills the target), ls, then `gpucr-stream
// restore --from s3://...`.
func TestS3CheckpointRestore(t *testing.T) {
	e := startS3(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 128)
	url := e.url("fleet/host1/ck1")

	r := gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", url, "--json", "--work-dir", filepath.Join(dir, "w1")).ok(t, "checkpoint")
	var res struct {
		RawBytes int64 `json:"raw_bytes"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &res); err != nil || res.RawBytes < 100<<20 {
		t.Fatalf("checkpoint --json: %v: %s", err, r.stdout)
	}
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatal(err)
	}
	checkListed(t, ls(ctx, t, e.url("fleet")), "host1/ck1", 100<<20)

	rr := gcsRun(ctx, t, "restore", "--from", url, "--work-dir", filepath.Join(dir, "w2")).ok(t, "restore")
	if pid, _ := strconv.Atoi(strings.TrimSpace(rr.stdout)); pid != tg.PID() {
		t.Fatalf("restore printed %q, want pid %d", rr.stdout, tg.PID())
	}
	provenRestore(ctx, t, tg, before)
}

// TestS3MinioStoppedDuringCheckpoint: MinIO dies while `checkpoint --pid`
// uploads. The capture fails with a message that says so, criu dump fails
// and resumes the target, which runs on unharmed; ls never lists the
// broken checkpoint, gc removes its leftovers, and the target can still be
// checkpointed and restored.
func TestS3MinioStoppedDuringCheckpoint(t *testing.T) {
	e := startS3(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 256)
	url := e.url("broken")

	// Small segments and parts, so that uploads are under way from the
	// first megabytes on.
	ck := startGCS(ctx, t, gcsOpts{}, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", url,
		"--segment-size", "8MiB", "--s3-part-size", "5MiB", "--work-dir", filepath.Join(dir, "w1"))
	client := e.srv.Client(t)
	deadline := time.Now().Add(time.Minute)
	for {
		seen := false
		// A segment: the capture's lock comes first, before CRIU runs.
		for o := range client.ListObjects(ctx, s3Bucket, minio.ListObjectsOptions{Prefix: "broken/", Recursive: true}) {
			if o.Err == nil && strings.HasSuffix(o.Key, ".gcs") {
				seen = true
				break
			}
		}
		if seen {
			break
		}
		select {
		case <-ck.done:
			t.Fatalf("checkpoint ended before anything was uploaded: %v", ck.wait(ctx))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("no segment uploaded within a minute")
		}
		time.Sleep(5 * time.Millisecond)
	}
	e.srv.Stop()
	stopped := time.Now()
	select {
	case <-ck.done:
		t.Fatalf("checkpoint had already ended when MinIO stopped (%v): the fault hit nothing", ck.wait(ctx))
	default:
	}
	// How long CRIU keeps hold of the target (it is traced, TracerPid set,
	// while seized and frozen) after the store went away: the failure
	// must reach CRIU at once, not after the cleanup.
	frozen := make(chan time.Duration, 1)
	go func() {
		var last time.Time
		for {
			if tracerPID(tg.PID()) != 0 {
				last = time.Now()
			}
			select {
			case <-ck.done:
				frozen <- max(0, last.Sub(stopped))
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}()
	err := ck.wait(ctx)
	held := <-frozen
	t.Logf("target held by CRIU until %v after MinIO stopped", held.Round(time.Millisecond))
	// Two retries of the refused connection (under a second) and no
	// cleanup: that comes after CRIU let go.
	if held > 10*time.Second {
		t.Errorf("CRIU held the target %v after the store went away", held)
	}
	t.Logf("checkpoint failed %v after MinIO stopped: %v", time.Since(stopped).Round(time.Millisecond), err)
	if err == nil {
		t.Fatal("checkpoint succeeded with MinIO stopped in the middle")
	}
	msg := ck.stderr.String()
	if ck.cmd.ProcessState.ExitCode() != 1 || !strings.Contains(msg, "capture failed") || !strings.Contains(msg, "s3://"+s3Bucket+"/broken") ||
		!strings.Contains(msg, "connection refused") || !strings.Contains(msg, "criu dump") {
		t.Fatalf("checkpoint: exit %d, want 1 with a message naming the failed upload and criu: %s", ck.cmd.ProcessState.ExitCode(), msg)
	}
	noSecret(t, gcsResult{stderr: msg}, e.srv.SecretKey())

	// CRIU resumed the target: it runs on, memory intact, and has gone on
	// counting.
	if !pidRunning(tg.PID()) || !pidRunning(tg.ChildPID()) {
		t.Fatalf("target %d/%d not running after the failed checkpoint", tg.PID(), tg.ChildPID())
	}
	after, err := tg.Prove(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := after.Check(before); err != nil {
		t.Fatalf("target after the failed checkpoint: %v", err)
	}

	e.srv.Restart(t)
	if items := ls(ctx, t, e.url("")); len(items) != 0 {
		t.Fatalf("ls lists a broken checkpoint: %+v", items)
	}
	for _, k := range e.keys(ctx, t, "broken/") {
		if strings.HasSuffix(k, manifest.ManifestName) {
			t.Fatalf("a manifest was committed: %s", k)
		}
	}
	if r := gcsRun(ctx, t, "restore", "--from", url); r.code != 4 {
		t.Fatalf("restore from the broken checkpoint: exit %d, want 4 (not found): %s", r.code, r.stderr)
	}
	left, ups := e.keys(ctx, t, "broken/"), e.uploads(ctx, t, "broken/")
	t.Logf("left behind: %d objects, %d multipart uploads", len(left), len(ups))
	gc := gcsRun(ctx, t, "gc", "--older-than", "0s", "--json", e.url("")).ok(t, "gc")
	t.Logf("gc: %s", strings.TrimSpace(gc.stdout))
	if k, u := e.keys(ctx, t, "broken/"), e.uploads(ctx, t, "broken/"); len(k) != 0 || len(u) != 0 {
		t.Fatalf("after gc: objects %v, uploads %v", k, u)
	}

	// Unharmed means it can still be checkpointed and restored.
	again := e.url("again")
	gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", again, "--work-dir", filepath.Join(dir, "w2")).ok(t, "checkpoint again")
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatal(err)
	}
	gcsRun(ctx, t, "restore", "--from", again, "--work-dir", filepath.Join(dir, "w3")).ok(t, "restore")
	provenRestore(ctx, t, tg, after)
}

// TestS3MinioRestartDuringRestore: MinIO goes away while serve feeds
// criu restore from S3, once before the first image is read and once in
// the middle of the pages. Each restore either retries through (and the
// target is proven intact) or fails cleanly: serve exits non-zero and no
// restored target runs.
func TestS3MinioRestartDuringRestore(t *testing.T) {
	e := startS3(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 256)

	for i, tc := range []struct {
		name string
		// down stops MinIO while criu restore runs, and brings it back.
		down func(t *testing.T, criuStarted time.Time)
	}{
		{"before-first-read", nil},
		{"mid-pages", func(t *testing.T, criuStarted time.Time) {
			time.Sleep(time.Until(criuStarted.Add(150 * time.Millisecond)))
			e.srv.Restart(t)
		}},
	} {
		url := e.url("r/" + tc.name)
		gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", url, "--work-dir", filepath.Join(dir, fmt.Sprintf("wc%d", i))).ok(t, "checkpoint")
		if err := tg.WaitGone(ctx); err != nil {
			t.Fatal(err)
		}
		b := mkdir(t, filepath.Join(dir, fmt.Sprintf("b%d", i)))
		serve := startGCS(ctx, t, gcsOpts{}, "--images-dir", b, "serve", "--from", url)
		if !serve.waitLine(ctx, "socket-init") {
			t.Fatalf("serve: %v", serve.wait(ctx))
		}
		var restarted chan struct{}
		if tc.down == nil {
			// The manifest is read; now the server goes away before CRIU
			// asks for its first image, and comes back a moment later.
			e.srv.Stop()
			restarted = make(chan struct{})
			go func() {
				defer close(restarted)
				time.Sleep(1500 * time.Millisecond)
				e.srv.Restart(t)
			}()
		}
		criuStarted := time.Now()
		criuDone := make(chan error, 1)
		go func() {
			criuDone <- RunCRIU(ctx, t, "restore", "--stream", "-D", b, "--restore-detached", "-o", "restore.log", "-v4")
		}()
		if tc.down != nil {
			tc.down(t, criuStarted)
		} else {
			<-restarted
		}
		criuErr := <-criuDone
		serveErr := serve.wait(ctx)
		t.Logf("%s: criu restore: %v; serve: %v", tc.name, criuErr, serveErr)
		if criuErr == nil && serveErr == nil {
			t.Logf("%s: the restore retried through", tc.name)
			provenRestore(ctx, t, tg, before)
			p, err := tg.Prove(ctx)
			if err != nil {
				t.Fatal(err)
			}
			before = p
			continue
		}
		// Failed: cleanly, with no target left running.
		if serveErr == nil {
			t.Fatalf("%s: criu restore failed but serve reports success: %v", tc.name, criuErr)
		}
		mustBeGone(ctx, t, tg)
		t.Logf("%s: the restore failed cleanly", tc.name)
		// The checkpoint itself is fine: restore it for the next case.
		e.srv.Restart(t)
		gcsRun(ctx, t, "restore", "--from", url, "--work-dir", filepath.Join(dir, fmt.Sprintf("wr%d", i))).ok(t, "restore after the fault")
		provenRestore(ctx, t, tg, before)
		p, err := tg.Prove(ctx)
		if err != nil {
			t.Fatal(err)
		}
		before = p
	}
}

// TestS3BadCredentialsAndBucket: wrong, missing credentials and a missing
// bucket are reported before anything happens to the process, with a
// message that says which, a non-zero exit, and no secret printed.
func TestS3BadCredentialsAndBucket(t *testing.T) {
	e := startS3(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 64)
	pid := strconv.Itoa(tg.PID())
	url := e.url("creds/ck")
	secret := e.srv.SecretKey()

	const wrong = "wrong-secret-0123456789"
	t.Setenv("AWS_SECRET_ACCESS_KEY", wrong)
	for _, args := range [][]string{
		{"checkpoint", "--pid", pid, "--to", url},
		{"ls", e.url("creds")},
		{"inspect", url},
		{"restore", "--from", url},
	} {
		r := gcsRun(ctx, t, args...)
		if r.code != 1 || !strings.Contains(r.stderr, "credentials refused") || !strings.Contains(r.stderr, "SignatureDoesNotMatch") {
			t.Fatalf("%s with a wrong secret: exit %d, want 1 and a clear message: %s", args[0], r.code, r.stderr)
		}
		noSecret(t, r, wrong, secret)
	}
	t.Setenv("AWS_ACCESS_KEY_ID", "nobody")
	if r := gcsRun(ctx, t, "ls", e.url("creds")); r.code != 1 || !strings.Contains(r.stderr, "InvalidAccessKeyId") {
		t.Fatalf("ls with an unknown access key: exit %d: %s", r.code, r.stderr)
	}
	os.Unsetenv("AWS_ACCESS_KEY_ID")
	os.Unsetenv("AWS_SECRET_ACCESS_KEY")
	for _, args := range [][]string{{"checkpoint", "--pid", pid, "--to", url}, {"ls", e.url("creds")}} {
		r := gcsRun(ctx, t, args...)
		if r.code != 1 || !strings.Contains(r.stderr, "no S3 credentials found") || !strings.Contains(r.stderr, "anonymous access is never used") {
			t.Fatalf("%s without credentials: exit %d, want 1 and a clear message: %s", args[0], r.code, r.stderr)
		}
	}
	t.Setenv("AWS_ACCESS_KEY_ID", e.srv.AccessKey())
	t.Setenv("AWS_SECRET_ACCESS_KEY", secret)
	for _, args := range [][]string{
		{"checkpoint", "--pid", pid, "--to", "s3://no-such-bucket/ck"},
		{"ls", "s3://no-such-bucket/x"},
		{"restore", "--from", "s3://no-such-bucket/ck"},
	} {
		r := gcsRun(ctx, t, args...)
		if r.code != 4 || !strings.Contains(r.stderr, "s3://no-such-bucket: no such bucket") {
			t.Fatalf("%s into a missing bucket: exit %d, want 4 and a clear message: %s", args[0], r.code, r.stderr)
		}
		noSecret(t, r, secret)
	}
	// capture fails before it listens, so criu never starts.
	a := mkdir(t, filepath.Join(dir, "a"))
	t.Setenv("AWS_SECRET_ACCESS_KEY", wrong)
	capture := startGCS(ctx, t, gcsOpts{}, "--images-dir", a, "capture", "--to", url)
	if capture.waitLine(ctx, "socket-init") {
		t.Fatal("capture listened with wrong credentials")
	}
	if code := capture.exitCode(ctx); code != 1 {
		t.Fatalf("capture with wrong credentials: exit %d", code)
	}
	// None of this touched the target.
	p, err := tg.Prove(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Check(before); err != nil {
		t.Fatal(err)
	}
	if keys := e.keys(ctx, t, ""); len(keys) != 0 {
		t.Fatalf("objects written: %v", keys)
	}
}

// TestS3CorruptObject: one byte flipped in a segment object in the bucket.
// verify and restore both fail with exit 3 and a message naming the
// segment; no restored target runs.
func TestS3CorruptObject(t *testing.T) {
	e := startS3(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, _ := startedTarget(ctx, t, dir, 64)
	url := e.url("c/ck")
	gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", url, "--segment-size", "16MiB", "--work-dir", filepath.Join(dir, "w1")).ok(t, "checkpoint")
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatal(err)
	}
	gcsRun(ctx, t, "verify", url).ok(t, "verify before the damage")

	client := e.srv.Client(t)
	get := func(key string) []byte {
		o, err := client.GetObject(ctx, s3Bucket, key, minio.GetObjectOptions{})
		if err != nil {
			t.Fatal(err)
		}
		defer o.Close()
		b, err := io.ReadAll(o)
		if err != nil {
			t.Fatalf("get %s: %v", key, err)
		}
		return b
	}
	m, err := manifest.Parse(get("c/ck/" + manifest.ManifestName))
	if err != nil {
		t.Fatal(err)
	}
	// A stored chunk in the middle of the pages.
	var seg string
	var pos int64
	for _, f := range m.Files {
		if !strings.HasPrefix(f.Name, "pages-") {
			continue
		}
		for _, c := range f.Chunks[len(f.Chunks)/2:] {
			if codec.ID(c.Codec) != codec.Zero && c.Stored > 16 {
				seg, pos = m.Segments[c.Segment].Name, c.Pos+manifest.FrameSize+int64(c.Stored)/2
				break
			}
		}
		if seg != "" {
			break
		}
	}
	if seg == "" {
		t.Fatal("no stored pages chunk to damage")
	}
	data := get("c/ck/" + seg)
	data[pos] ^= 0x10
	if _, err := client.PutObject(ctx, s3Bucket, "c/ck/"+seg, bytes.NewReader(data), int64(len(data)), minio.PutObjectOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Logf("flipped byte %d of %s", pos, seg)

	v := gcsRun(ctx, t, "verify", url)
	if v.code != 3 || !strings.Contains(v.stderr, seg) {
		t.Fatalf("verify of a damaged segment: exit %d, want 3 naming %s: %s", v.code, seg, v.stderr)
	}
	b := mkdir(t, filepath.Join(dir, "b"))
	serve := startGCS(ctx, t, gcsOpts{}, "--images-dir", b, "serve", "--from", url)
	criuErr, serveErr := restoreThrough(ctx, t, b, serve)
	if criuErr == nil || serveErr == nil || serve.cmd.ProcessState.ExitCode() != 3 || !strings.Contains(serve.stderr.String(), seg) {
		t.Fatalf("restore from a damaged segment: criu %v, serve exit %d: %v", criuErr, serve.cmd.ProcessState.ExitCode(), serveErr)
	}
	// What CRIU forked before it failed dies with the restore (CRIU kills
	// it): no target may be left running.
	mustBeGone(ctx, t, tg)
	r := gcsRun(ctx, t, "restore", "--from", url, "--work-dir", filepath.Join(dir, "w2"))
	if r.code != 3 || !strings.Contains(r.stderr, seg) {
		t.Fatalf("gpucr-stream restore from a damaged segment: exit %d (want 3): %s", r.code, r.stderr)
	}
	mustBeGone(ctx, t, tg)
}

// mustBeGone fails unless the target's pids are gone within seconds of a
// failed restore (a half-restored tree is killed by CRIU, or by
// gpucr-stream restore when serving failed).
func mustBeGone(ctx context.Context, t testing.TB, tg *Target) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatalf("a target runs after a failed restore: %v", err)
	}
}

// tracerPID is the pid tracing pid (CRIU while it holds the process), or 0.
func tracerPID(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "TracerPid:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}
