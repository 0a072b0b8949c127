package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// TestCRIUPlainDumpRestore checks the ground the streamer stands on: a
// plain criu dump to a directory and restore from it bring the target back
// with its memory, child and counter intact. If this fails, CRIU or the
// target is broken, not gpucr-stream.
func TestCRIUPlainDumpRestore(t *testing.T) {
	CRIU(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	dir := ShortTempDir(t)
	// criu dump does not create its images dir.
	images := filepath.Join(dir, "img")
	if err := os.Mkdir(images, 0o755); err != nil {
		t.Fatal(err)
	}
	tg := StartTarget(t, filepath.Join(dir, "target"), 64)

	before, err := tg.Prove(ctx)
	if err != nil {
		t.Fatalf("proof before dump: %v", err)
	}
	if err := before.Verify(); err != nil {
		t.Fatalf("proof before dump: %v", err)
	}

	if err := RunCRIU(ctx, t, "dump", "-D", images, "-t", strconv.Itoa(tg.PID()), "-o", "dump.log", "-v4"); err != nil {
		t.Fatal(err)
	}
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatalf("after dump: %v", err)
	}
	if err := RunCRIU(ctx, t, "restore", "-D", images, "--restore-detached", "-o", "restore.log", "-v4"); err != nil {
		t.Fatal(err)
	}

	// Checked twice: the restored tree keeps running, not just answers once.
	provenRestore(ctx, t, tg, before)
	tg.Kill()
}
