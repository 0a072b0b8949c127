package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// capturedStream dumps a fresh target of mb MiB through capture to a
// stream file and returns it with the target and its proof.
func capturedStream(t *testing.T, mb int) (dir, stream string, tg *Target, before Proof) {
	t.Helper()
	ctx := testCtx(t)
	dir = ShortTempDir(t)
	tg, before = startedTarget(ctx, t, dir, mb)
	stream = filepath.Join(dir, "ckpt.stream")
	out, err := os.Create(stream)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	a := mkdir(t, filepath.Join(dir, "a"))
	dumpThrough(ctx, t, tg, a, startGCS(ctx, t, gcsOpts{stdout: out}, "--images-dir", a, "capture"))
	return dir, stream, tg, before
}

// TestServeEarly: `serve --early` from a pipe lets `criu restore --stream`
// start before the stream has ended. The stream is written but for its
// last 64 bytes (the END frame), and held there until serve logs CRIU's
// first request; only then does the rest go in. A serve that waits
// for the stream's end never gets that request and the test times out.
// The restored target must prove itself, and the progress lines come
// socket-init first, the statistics line last.
func TestServeEarly(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir, stream, tg, before := capturedStream(t, 128)
	data, err := os.ReadFile(stream)
	if err != nil {
		t.Fatal(err)
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pw.Close()
	er, ew := io.Pipe()
	asked := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(er)
		for sc.Scan() {
			if strings.Contains(sc.Text(), "criu asked for its first file") && strings.Contains(sc.Text(), "while the stream is still being read") {
				asked <- sc.Text()
			}
		}
		io.Copy(io.Discard, er)
	}()
	defer ew.Close()
	b := mkdir(t, filepath.Join(dir, "b"))
	serve := startGCS(ctx, t, gcsOpts{stdin: pr, stderr: ew}, "--images-dir", b, "serve", "--early")
	pr.Close()
	// serve tells its format from the stream's first bytes: they go in
	// beside, all of the stream but its end.
	const held = 64
	wrote := make(chan error, 1)
	go func() {
		_, err := pw.Write(data[:len(data)-held])
		wrote <- err
	}()
	lctx, cancel := context.WithTimeout(ctx, 30*time.Second) // a serve that waits for the end never listens
	defer cancel()
	if !serve.waitLine(lctx, "socket-init") {
		t.Fatalf("serve --early ended before listening: %v", serve.wait(ctx))
	}
	criuDone := make(chan error, 1)
	go func() {
		criuDone <- RunCRIU(ctx, t, "restore", "--stream", "-D", b, "--restore-detached", "-o", "restore.log", "-v4")
	}()
	if err := <-wrote; err != nil {
		t.Fatalf("write the stream: %v (serve: %v)", err, serve.wait(ctx))
	}
	select {
	case line := <-asked:
		t.Logf("with %d bytes of the stream held back: %s", held, line)
	case err := <-criuDone:
		t.Fatalf("criu ended before the stream did: %v; serve: %v", err, serve.wait(ctx))
	case <-ctx.Done():
		t.Fatalf("criu's first request never reached serve before the stream's end: %v", ctx.Err())
	}
	if _, err := pw.Write(data[len(data)-held:]); err != nil {
		t.Fatal(err)
	}
	pw.Close()
	if err := <-criuDone; err != nil {
		t.Fatalf("criu restore: %v; serve: %v", err, serve.wait(ctx))
	}
	if err := serve.wait(ctx); err != nil {
		t.Fatalf("serve: %v", err)
	}
	if !strings.Contains(serve.stderr.String(), "ms before the stream ended") {
		t.Errorf("serve did not say when criu asked against the stream's end: %s", serve.stderr.String())
	}
	lines := serve.lines() // socket-init was consumed above: the statistics line is all that is left
	var st Stats
	if len(lines) != 1 || json.Unmarshal([]byte(lines[0]), &st) != nil || st.RawBytes == 0 {
		t.Errorf("progress after socket-init %q: want the statistics line alone", lines)
	}
	provenRestore(ctx, t, tg, before)
}

// Stats is the part of the statistics line the tests read.
type Stats struct {
	RawBytes int64 `json:"raw_bytes"`
}

// TestRestoreFromStreamCut: `restore --from -` lets CRIU restore while the
// stream is read; a stream cut short (its last byte missing, the files
// themselves whole) is a damaged checkpoint: restore fails, and nothing it
// restored is left running.
func TestRestoreFromStreamCut(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir, stream, tg, _ := capturedStream(t, 64)
	data, err := os.ReadFile(stream)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, BuildBinary(t, "./cmd/gpucr-stream"), "restore", "--from", "-", "--criu", CRIU(t),
		"--work-dir", filepath.Join(dir, "w"), "--no-progress")
	cmd.Stdin = bytes.NewReader(data[:len(data)-1])
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("restore from a cut stream succeeded: %s", out)
	}
	if err := tg.WaitGone(ctx); err != nil || pidExists(tg.PID()) {
		t.Fatalf("restore from a cut stream left the target running: %v (restore said %s)", err, out)
	}
	t.Logf("restore from a cut stream: %v: %s", err, bytes.TrimSpace(out))
}
