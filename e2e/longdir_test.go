package e2e

// Images dirs longer than a unix socket path allows (issue 39, item 4):
// Podman's .../userdata/checkpoint is about 150 bytes.

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// longPath is a directory under dir whose path is at least n bytes.
func longPath(t *testing.T, dir string, n int) string {
	t.Helper()
	for len(dir) < n {
		dir = filepath.Join(dir, "overlay-containers-0123456789abcdef-userdata")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestLongImagesDir: with 200-byte images dirs, `checkpoint` and `restore`
// (CRIU run by gpucr-stream) and the drop-in `capture` and `serve` (CRIU
// run by the test, reaching the directory through /proc/PID/fd/N, as
// gpucr-stream's swrk gives it) bring the target back intact.
func TestLongImagesDir(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 32)
	archive := filepath.Join(dir, "archive")
	work := longPath(t, filepath.Join(dir, "w1"), 200)
	gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", archive, "--work-dir", work).ok(t, "checkpoint with a 200-byte work dir")
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatal(err)
	}
	gcsRun(ctx, t, "restore", "--from", archive, "--work-dir", longPath(t, filepath.Join(dir, "w2"), 200)).ok(t, "restore with a 200-byte work dir")
	provenRestore(ctx, t, tg, before)

	// The drop-in commands: CRIU gets a short path to the same directory.
	before, err := tg.Prove(ctx)
	if err != nil {
		t.Fatal(err)
	}
	images := longPath(t, filepath.Join(dir, "a"), 200)
	d, err := os.Open(images)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	short := fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), d.Fd())
	stream := filepath.Join(dir, "stream.archive")
	capture := startGCS(ctx, t, gcsOpts{}, "--images-dir", images, "capture", "--to", stream)
	dumpThrough(ctx, t, tg, short, capture)
	serve := startGCS(ctx, t, gcsOpts{}, "--images-dir", images, "serve", "--from", stream)
	if criuErr, serveErr := restoreThrough(ctx, t, short, serve); criuErr != nil || serveErr != nil {
		t.Fatalf("restore through a 200-byte images dir: criu: %v; serve: %v", criuErr, serveErr)
	}
	provenRestore(ctx, t, tg, before)
}
