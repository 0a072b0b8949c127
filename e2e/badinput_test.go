package e2e

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/manifest"
)

// TestExtractByteIdentical: images written by a plain `criu dump -D` are
// pushed through the capture socket exactly as CRIU streams them; extract
// must give back byte-identical files, and criu restore -D from those files
// must bring the target back.
func TestExtractByteIdentical(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 128)
	plain := mkdir(t, filepath.Join(dir, "plain"))
	if err := RunCRIU(ctx, t, "dump", "-D", plain, "-t", strconv.Itoa(tg.PID()), "-o", "dump.log", "-v4"); err != nil {
		t.Fatal(err)
	}
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatal(err)
	}
	for _, codec := range []string{"lz4", "auto"} {
		a := mkdir(t, filepath.Join(dir, "a-"+codec))
		var stream bytes.Buffer
		cap := startGCS(ctx, t, gcsOpts{stdout: &stream}, "--images-dir", a, "capture", "--codec", codec, "--chunk-size", "1MiB")
		if !cap.waitLine(ctx, "socket-init") {
			t.Fatalf("capture: %v", cap.wait(ctx))
		}
		cl, err := criusock.Dial(ctx, a)
		if err != nil {
			t.Fatal(err)
		}
		n, err := cl.PushDir(ctx, plain)
		if err != nil {
			t.Fatal(err)
		}
		cl.Close()
		if err := cap.wait(ctx); err != nil {
			t.Fatal(err)
		}
		x := mkdir(t, filepath.Join(dir, "x-"+codec))
		ext := startGCS(ctx, t, gcsOpts{stdin: &stream}, "--images-dir", x, "extract")
		if err := ext.wait(ctx); err != nil {
			t.Fatal(err)
		}
		ents, _ := os.ReadDir(plain)
		compared := 0
		for _, e := range ents {
			if filepath.Ext(e.Name()) != ".img" {
				continue
			}
			want, _ := os.ReadFile(filepath.Join(plain, e.Name()))
			got, err := os.ReadFile(filepath.Join(x, e.Name()))
			if err != nil {
				t.Fatalf("%s: extract did not write %s: %v", codec, e.Name(), err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("%s: %s differs after extract (%d bytes, want %d)", codec, e.Name(), len(got), len(want))
			}
			compared++
		}
		if compared != n || compared < 10 {
			t.Fatalf("%s: compared %d files, pushed %d", codec, compared, n)
		}
		t.Logf("%s: %d files byte-identical (stream %d bytes)", codec, compared, stream.Len())
	}
	x := filepath.Join(dir, "x-auto")
	if err := RunCRIU(ctx, t, "restore", "-D", x, "--restore-detached", "-o", "restore.log", "-v4"); err != nil {
		t.Fatal(err)
	}
	provenRestore(ctx, t, tg, before)
}

// TestBadInputNeverRestores: every kind of damaged input makes serve fail
// with a message that says what and where, a distinct exit code, and a
// criu restore that fails cleanly: no process comes back from bad data.
// Then the intact stream restores the same target, which shows the failed
// attempts left nothing behind.
func TestBadInputNeverRestores(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 64)
	a := mkdir(t, filepath.Join(dir, "a"))
	var good bytes.Buffer
	cap := startGCS(ctx, t, gcsOpts{stdout: &good}, "--images-dir", a, "capture", "--chunk-size", "1MiB")
	dumpThrough(ctx, t, tg, a, cap)
	stream := good.Bytes()

	// An archive too, to damage on disk.
	archive := filepath.Join(dir, "archive")
	a2 := mkdir(t, filepath.Join(dir, "a2"))
	push := startGCS(ctx, t, gcsOpts{stdin: bytes.NewReader(stream)}, "--images-dir", a2, "extract")
	if err := push.wait(ctx); err != nil {
		t.Fatal(err)
	}
	a3 := mkdir(t, filepath.Join(dir, "a3"))
	cap2 := startGCS(ctx, t, gcsOpts{}, "--images-dir", a3, "capture", "--to", archive, "--segment-size", "8MiB")
	if !cap2.waitLine(ctx, "socket-init") {
		t.Fatal(cap2.wait(ctx))
	}
	cl, err := criusock.Dial(ctx, a3)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cl.PushDir(ctx, a2); err != nil {
		t.Fatal(err)
	}
	cl.Close()
	if err := cap2.wait(ctx); err != nil {
		t.Fatal(err)
	}

	flip := func(pos int) []byte {
		b := bytes.Clone(stream)
		b[pos] ^= 0x5a
		return b
	}
	newer := bytes.Clone(stream)
	newer[8] = manifest.Version + 1 // version field; checked before the header checksum
	garbage := make([]byte, 1<<20)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range garbage {
		garbage[i] = byte(rng.UintN(256))
	}
	cases := []struct {
		name     string
		input    []byte
		from     string
		code     int
		messages []string
	}{
		{"flipped byte in stream header", flip(20), "-", 3, []string{"offset 0", "checksum"}},
		{"flipped byte in first frame header", flip(32 + 5), "-", 3, []string{"offset 32", "frame header checksum"}},
		{"flipped byte in pages data", flip(len(stream) / 2), "-", 3, []string{"offset", "file pages-"}},
		{"flipped byte near the end", flip(len(stream) - 40), "-", 3, []string{"offset"}},
		{"flipped last byte", flip(len(stream) - 1), "-", 3, []string{"tail"}},
		{"truncated stream", stream[:len(stream)*2/3], "-", 3, []string{"truncated", "offset"}},
		{"newer format version", newer, "-", 5, []string{fmt.Sprintf("version %d", manifest.Version+1), "upgrade"}},
		{"garbage on stdin", garbage, "-", 3, []string{"not a gpucr-stream stream", "offset 0"}},
		{"empty stdin", nil, "-", 3, []string{"empty input"}},
		{"missing archive", nil, filepath.Join(dir, "no-such-archive"), 4, []string{"no-such-archive"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := mkdir(t, filepath.Join(dir, "b-"+strings.ReplaceAll(tc.name, " ", "-")))
			serve := startGCS(ctx, t, gcsOpts{stdin: bytes.NewReader(tc.input)}, "--images-dir", b, "serve", "--from", tc.from)
			expectFailedRestore(ctx, t, tg, b, serve, tc.code, tc.messages)
		})
	}

	// Damage inside an archive segment: the error names the segment and offset.
	segs, _ := filepath.Glob(filepath.Join(archive, "segments", "*.gcs"))
	if len(segs) < 2 {
		t.Fatalf("want several segments, got %v", segs)
	}
	t.Run("flipped byte in archive segment", func(t *testing.T) {
		seg := segs[0]
		data, _ := os.ReadFile(seg)
		orig := bytes.Clone(data)
		data[len(data)/2] ^= 0x5a
		os.WriteFile(seg, data, 0o644)
		defer os.WriteFile(seg, orig, 0o644)
		bin := BuildBinary(t, "./cmd/gpucr-stream")
		vf := startGCS(ctx, t, gcsOpts{}, "verify", archive)
		if code := vf.exitCode(ctx); code != 3 || !strings.Contains(vf.stderr.String(), filepath.Base(seg)) {
			t.Errorf("%s verify: exit %d, stderr %q", bin, code, vf.stderr.String())
		}
		b := mkdir(t, filepath.Join(dir, "b-seg"))
		serve := startGCS(ctx, t, gcsOpts{}, "--images-dir", b, "serve", "--from", archive)
		expectFailedRestore(ctx, t, tg, b, serve, 3, []string{filepath.Base(seg), "offset"})
	})
	t.Run("missing segment", func(t *testing.T) {
		seg := segs[len(segs)-1]
		data, _ := os.ReadFile(seg)
		os.Remove(seg)
		defer os.WriteFile(seg, data, 0o644)
		b := mkdir(t, filepath.Join(dir, "b-noseg"))
		serve := startGCS(ctx, t, gcsOpts{}, "--images-dir", b, "serve", "--from", archive)
		expectFailedRestore(ctx, t, tg, b, serve, 4, []string{filepath.Base(seg)})
	})

	// The intact stream still restores the target.
	b := mkdir(t, filepath.Join(dir, "b-good"))
	serve := startGCS(ctx, t, gcsOpts{stdin: bytes.NewReader(stream)}, "--images-dir", b, "serve")
	if criuErr, serveErr := restoreThrough(ctx, t, b, serve); criuErr != nil || serveErr != nil {
		t.Fatalf("restore from the intact stream: criu: %v; serve: %v", criuErr, serveErr)
	}
	provenRestore(ctx, t, tg, before)
}

// expectFailedRestore runs criu restore against a serve that must fail: it
// checks serve's exit code and message, that CRIU failed, and that the
// target did not come back.
func expectFailedRestore(ctx context.Context, t *testing.T, tg *Target, images string, serve *proc, code int, messages []string) {
	t.Helper()
	listening := serve.waitLine(ctx, "socket-init")
	var criuErr error
	if listening {
		criuErr = RunCRIU(ctx, t, "restore", "--stream", "-D", images, "--restore-detached", "-o", "restore.log", "-v4")
	} else {
		// serve gave up before listening; CRIU must find no server.
		criuErr = RunCRIU(ctx, t, "restore", "--stream", "-D", images, "--restore-detached", "-o", "restore.log")
	}
	got := serve.exitCode(ctx)
	stderr := serve.stderr.String()
	if got != code {
		t.Errorf("serve exit code %d, want %d; stderr: %s", got, code, stderr)
	}
	for _, m := range messages {
		if !strings.Contains(stderr, m) {
			t.Errorf("serve stderr lacks %q: %s", m, stderr)
		}
	}
	if criuErr == nil {
		t.Errorf("criu restore succeeded from bad input")
	}
	if err := tg.WaitGone(ctx); err != nil || pidExists(tg.PID()) {
		t.Errorf("a process with the target's pid exists after a failed restore: %v", err)
	}
	t.Logf("serve said: %s", strings.TrimSpace(lastLine(stderr)))
}

func lastLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:]
	}
	return s
}
