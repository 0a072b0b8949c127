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

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
)

// capturedStream dumps a fresh target of mb MiB through capture (with
// args) to a stream file and returns it with the target and its proof.
func capturedStream(t *testing.T, mb int, args ...string) (dir, stream string, tg *Target, before Proof) {
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
	dumpThrough(ctx, t, tg, a, startGCS(ctx, t, gcsOpts{stdout: out}, append([]string{"--images-dir", a, "capture"}, args...)...))
	return dir, stream, tg, before
}

// serveGated runs `serve --early` on data, given through a pipe but
// for data[gate:], gated until serve logs a line that wanted accepts,
// with `criu restore --stream` started at socket-init; it returns that line
// and the serve, ended, once criu restored. A serve that never logs such a
// line fails the test within 30 s.
func serveGated(ctx context.Context, t *testing.T, dir string, data []byte, gate int, wanted func(string) bool) (string, *proc) {
	t.Helper()
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pw.Close()
	er, ew := io.Pipe()
	logged := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(er)
		for sc.Scan() {
			if wanted(sc.Text()) {
				select {
				case logged <- sc.Text():
				default:
				}
			}
		}
		io.Copy(io.Discard, er)
	}()
	defer ew.Close()
	b := mkdir(t, filepath.Join(dir, "b"))
	serve := startGCS(ctx, t, gcsOpts{stdin: pr, stderr: ew}, "--images-dir", b, "serve", "--early")
	pr.Close()
	// serve tells its format from the stream's first bytes: they go in
	// beside.
	wrote := make(chan error, 1)
	go func() {
		_, err := pw.Write(data[:gate])
		wrote <- err
	}()
	lctx, cancel := context.WithTimeout(ctx, 30*time.Second) // a serve that waits for the end never logs it
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
	var line string
	select {
	case line = <-logged:
	case err := <-criuDone:
		t.Fatalf("criu ended before the stream did: %v; serve: %v", err, serve.wait(ctx))
	case <-lctx.Done():
		t.Fatalf("with the last %d bytes of the stream held back, serve never logged what the test waits for: %v", len(data)-gate, lctx.Err())
	}
	if _, err := pw.Write(data[gate:]); err != nil {
		t.Fatal(err)
	}
	pw.Close()
	if err := <-criuDone; err != nil {
		t.Fatalf("criu restore: %v; serve: %v", err, serve.wait(ctx))
	}
	if err := serve.wait(ctx); err != nil {
		t.Fatalf("serve: %v", err)
	}
	return line, serve
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
	const held = 64
	line, serve := serveGated(ctx, t, dir, data, len(data)-held, func(l string) bool {
		return strings.Contains(l, "criu asked for its first file") && strings.Contains(l, "while the stream is still being read")
	})
	t.Logf("with %d bytes of the stream held back: %s", held, line)
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

// lastPagesFrame is where the stream's last DATA frame of a page image
// with data starts; it fails the test unless every FILE-END comes before
// it (the page images were held back: capture --pages-last).
func lastPagesFrame(t *testing.T, data []byte) int64 {
	t.Helper()
	last, lastEnd, _ := scanPages(t, data)
	if last < 0 || lastEnd > last {
		t.Fatalf("the stream's last page data at %d, its last FILE-END at %d: the pages were not sent last", last, lastEnd)
	}
	return last
}

// scanPages reads a one-shard stream's frames: where its last non-zero
// chunk of a page image and its last FILE-END are (-1: none), and the raw
// bytes of the page images' zero chunks.
func scanPages(t *testing.T, data []byte) (last, lastEnd, zero int64) {
	t.Helper()
	rd, err := manifest.NewReader(bytes.NewReader(data), "stream")
	if err != nil {
		t.Fatal(err)
	}
	last, lastEnd = -1, -1
	for {
		fr, err := rd.Next(nil)
		if err == io.EOF {
			return last, lastEnd, zero
		}
		if err != nil {
			t.Fatal(err)
		}
		pages := fr.Type == manifest.FrameData && strings.HasPrefix(fr.Name, "pages-")
		switch {
		case fr.Type == manifest.FrameFileEnd:
			lastEnd = fr.Pos
		case pages && codec.ID(fr.Codec) == codec.Zero:
			zero += int64(fr.RawLen)
		case pages:
			last = fr.Pos
		}
	}
}

// TestServePagesLast: a stream captured with --pages-last carries CRIU's
// page images after every other file, so `serve --early` lets CRIU restore
// from the small images and read the pages as they come. The stream goes in
// but for its last frame of page data, held until serve says it is copying
// a page image as it arrives (CRIU asked for it before its last chunk
// came; a serve that waited for whole files never says so and the test
// times out). The restored target must prove itself.
func TestServePagesLast(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir, stream, tg, before := capturedStream(t, 128, "--pages-last")
	data, err := os.ReadFile(stream)
	if err != nil {
		t.Fatal(err)
	}
	gate := lastPagesFrame(t, data)
	line, _ := serveGated(ctx, t, dir, data, int(gate), func(l string) bool {
		return strings.Contains(l, "pages-") && strings.Contains(l, "copied as it arrives")
	})
	t.Logf("with the last %d bytes of the stream held back: %s", len(data)-int(gate), line)
	provenRestore(ctx, t, tg, before)
}

// TestRestorePagesLast: `restore --from -` of a stream captured with
// --pages-last restores the target whole and leaves as many of its zero
// pages out of CRIU's restore as from a stream in dump order: the page
// images' zero chunks and ends come ahead of their data, in time for their
// pagemaps to be rewritten. The two streams are of two targets, whose zero
// pages differ a little (one more zero chunk in one of them): each is held
// to its own stream's zero chunks.
func TestRestorePagesLast(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	var sparse, zero [2]int64
	for i, args := range [][]string{nil, {"--pages-last"}} {
		dir, stream, tg, before := capturedStream(t, 128, args...)
		data, err := os.ReadFile(stream)
		if err != nil {
			t.Fatal(err)
		}
		if args != nil {
			lastPagesFrame(t, data)
		}
		_, _, zero[i] = scanPages(t, data)
		cmd := exec.CommandContext(ctx, BuildBinary(t, "./cmd/gpucr-stream"), "restore", "--from", "-", "--criu", CRIU(t),
			"--work-dir", filepath.Join(dir, "w"), "--no-progress", "--json")
		cmd.Stdin = bytes.NewReader(data)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("restore --from - of a stream captured with %q: %v: %s", args, err, stderr.Bytes())
		}
		var res struct {
			SparseBytes int64 `json:"sparse_bytes"`
		}
		if err := json.Unmarshal(out, &res); err != nil {
			t.Fatalf("restore printed %q: %v", out, err)
		}
		provenRestore(ctx, t, tg, before)
		tg.Kill()
		sparse[i] = res.SparseBytes
	}
	// Left out as a share of the page images' zero chunks: the pages last
	// may not leave out fewer than the dump order does (a zero chunk of a
	// private file mapping is never left out, in either).
	if sparse[0] == 0 || zero[0] == 0 || zero[1] == 0 || float64(sparse[1])/float64(zero[1]) < 0.9*float64(sparse[0])/float64(zero[0]) {
		t.Fatalf("zero bytes left out of the restore: %d of %d zero chunk bytes from a stream in dump order, %d of %d with the pages last",
			sparse[0], zero[0], sparse[1], zero[1])
	}
	t.Logf("zero bytes left out of the restore: %d of %d zero chunk bytes from a stream in dump order, %d of %d with the pages last",
		sparse[0], zero[0], sparse[1], zero[1])
}
