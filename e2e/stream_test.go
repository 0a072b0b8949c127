package e2e

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestStreamStdoutToStdin: criu dump --stream through capture to stdout,
// then serve of that stream from stdin into criu restore --stream.
func TestStreamStdoutToStdin(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 256)

	streamPath := filepath.Join(dir, "ckpt.stream")
	out, err := os.Create(streamPath)
	if err != nil {
		t.Fatal(err)
	}
	a := mkdir(t, filepath.Join(dir, "a"))
	capture := startGCS(ctx, t, gcsOpts{stdout: out}, "--images-dir", a, "capture")
	dumpThrough(ctx, t, tg, a, capture)
	out.Close()
	lines := capture.lines()
	checkStatsLine(t, lines)

	restoreStream(ctx, t, dir, streamPath)
	provenRestore(ctx, t, tg, before)
}

// checkStatsLine checks the criu-image-streamer compatible progress lines.
func checkStatsLine(t *testing.T, lines []string) {
	t.Helper()
	// socket-init was consumed by dumpThrough.
	if len(lines) < 2 || lines[0] != "checkpoint-start" {
		t.Fatalf("progress lines after socket-init %q: want checkpoint-start, statistics", lines)
	}
	var st struct {
		Shards []struct {
			Size int64 `json:"size"`
		} `json:"shards"`
		RawBytes int64 `json:"raw_bytes"`
	}
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &st); err != nil || len(st.Shards) == 0 || st.Shards[0].Size == 0 || st.RawBytes == 0 {
		t.Fatalf("statistics line %q: %v", lines[len(lines)-1], err)
	}
}

// TestArchiveEveryCodec: capture --to a local archive and serve --from it,
// once per codec (and once with --chunk-hashes); inspect and verify must
// agree with what was written.
func TestArchiveEveryCodec(t *testing.T) {
	CRIU(t)
	for _, tc := range []struct {
		codec  string
		hashes bool
	}{{"none", false}, {"lz4", false}, {"zstd", false}, {"zstd:9", false}, {"shuffle", false}, {"auto", false}, {"lz4", true}} {
		codec := tc.codec
		name := strings.ReplaceAll(codec, ":", "-")
		args := []string{"--images-dir", "", "capture", "--to", "", "--codec", codec, "--segment-size", "32MiB"}
		if tc.hashes {
			name += "-chunk-hashes"
			args = append(args, "--chunk-hashes")
		}
		t.Run(name, func(t *testing.T) {
			ctx := testCtx(t)
			dir := ShortTempDir(t)
			tg, before := startedTarget(ctx, t, dir, 96)
			archive := filepath.Join(dir, "archive")
			a := mkdir(t, filepath.Join(dir, "a"))
			args[1], args[4] = a, archive
			capture := startGCS(ctx, t, gcsOpts{}, args...)
			dumpThrough(ctx, t, tg, a, capture)

			bin := BuildBinary(t, "./cmd/gpucr-stream")
			out, err := exec.CommandContext(ctx, bin, "inspect", "--json", archive).CombinedOutput()
			if err != nil {
				t.Fatalf("inspect: %v: %s", err, out)
			}
			var ins struct {
				Format      int         `json:"format"`
				ChunkHashes bool        `json:"chunk_hashes"`
				Codec       string      `json:"codec"`
				Segments    int         `json:"segments"`
				Files       []fileEntry `json:"files"`
			}
			if err := json.Unmarshal(out, &ins); err != nil {
				t.Fatalf("inspect --json: %v: %s", err, out)
			}
			if ins.Codec != codec && !(codec == "zstd" && ins.Codec == "zstd:1") {
				t.Errorf("inspect says codec %q, captured with %q", ins.Codec, codec)
			}
			if want := map[bool]int{false: 3, true: 1}[tc.hashes]; ins.Format != want || ins.ChunkHashes != tc.hashes {
				t.Errorf("inspect says format %d, chunk hashes %v; captured with --chunk-hashes=%v", ins.Format, ins.ChunkHashes, tc.hashes)
			}
			if ins.Segments < 2 {
				t.Errorf("want several 32 MiB segments for a 96 MiB target, got %d", ins.Segments)
			}
			if !hasFile(ins.Files, "inventory.img") {
				t.Errorf("inspect lists no inventory.img: %s", out)
			}
			if out, err := exec.CommandContext(ctx, bin, "verify", archive).CombinedOutput(); err != nil {
				t.Fatalf("verify: %v: %s", err, out)
			}

			b := mkdir(t, filepath.Join(dir, "b"))
			serve := startGCS(ctx, t, gcsOpts{}, "--images-dir", b, "serve", "--from", "file://"+archive)
			if criuErr, serveErr := restoreThrough(ctx, t, b, serve); criuErr != nil || serveErr != nil {
				t.Fatalf("restore: criu: %v; serve: %v", criuErr, serveErr)
			}
			provenRestore(ctx, t, tg, before)
		})
	}
}

type fileEntry struct {
	Name string `json:"name"`
}

func hasFile(files []fileEntry, name string) bool {
	for _, f := range files {
		if f.Name == name {
			return true
		}
	}
	return false
}

// TestThreeShards spreads the stream over three pipes (--shard-fds) and
// gathers it back from three, carrying an extra file (--ext-file-fds, as
// for a root filesystem tarball) alongside CRIU's images.
func TestThreeShards(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 128)

	extData := make([]byte, 3<<20+17)
	rng := rand.New(rand.NewPCG(7, 8))
	for i := range extData {
		extData[i] = byte(rng.UintN(256))
	}
	extIn := filepath.Join(dir, "rootfs.tar")
	if err := os.WriteFile(extIn, extData, 0o644); err != nil {
		t.Fatal(err)
	}
	ext, err := os.Open(extIn)
	if err != nil {
		t.Fatal(err)
	}
	defer ext.Close()

	var outs, ins []*os.File
	var cats []*exec.Cmd
	for i := range 3 {
		// Real pipes, each drained into a file, as a user's script would.
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		f, err := os.Create(filepath.Join(dir, "shard"+strconv.Itoa(i)))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		cat := exec.CommandContext(ctx, "cat")
		cat.Stdin, cat.Stdout = r, f
		if err := cat.Start(); err != nil {
			t.Fatal(err)
		}
		r.Close()
		cats = append(cats, cat)
		outs = append(outs, w)
	}
	a := mkdir(t, filepath.Join(dir, "a"))
	capture := startGCS(ctx, t, gcsOpts{extra: append(outs, ext)}, "--images-dir", a, "--shard-fds", "4,5,6", "--ext-file-fds", "rootfs.tar:7", "capture")
	for _, w := range outs {
		w.Close() // the capture holds its own copies
	}
	dumpThrough(ctx, t, tg, a, capture)
	for _, c := range cats {
		if err := c.Wait(); err != nil {
			t.Fatal(err)
		}
	}

	for i := range 3 {
		f, err := os.Open(filepath.Join(dir, "shard"+strconv.Itoa(i)))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		st, _ := f.Stat()
		if st.Size() < 10<<20 {
			t.Errorf("shard %d holds only %d bytes: data not spread", i, st.Size())
		}
		ins = append(ins, f)
	}
	extOut, err := os.Create(filepath.Join(dir, "rootfs.out"))
	if err != nil {
		t.Fatal(err)
	}
	defer extOut.Close()
	b := mkdir(t, filepath.Join(dir, "b"))
	serve := startGCS(ctx, t, gcsOpts{extra: append(ins, extOut)}, "--images-dir", b, "--shard-fds", "4,5,6", "--ext-file-fds", "rootfs.tar:7", "serve")
	if criuErr, serveErr := restoreThrough(ctx, t, b, serve); criuErr != nil || serveErr != nil {
		t.Fatalf("restore: criu: %v; serve: %v", criuErr, serveErr)
	}
	provenRestore(ctx, t, tg, before)
	got, err := os.ReadFile(extOut.Name())
	if err != nil || !bytes.Equal(got, extData) {
		t.Fatalf("ext file came back with %d bytes (want %d identical): %v", len(got), len(extData), err)
	}
}

// TestShellPipe runs the form users type:
// gpucr-stream --images-dir A capture | gpucr-stream --images-dir B serve
func TestShellPipe(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 128)
	bin := BuildBinary(t, "./cmd/gpucr-stream")
	a := mkdir(t, filepath.Join(dir, "a"))
	b := mkdir(t, filepath.Join(dir, "b"))
	sh := exec.CommandContext(ctx, "bash", "-o", "pipefail", "-c",
		bin+" --images-dir "+a+" capture | "+bin+" --images-dir "+b+" serve")
	var stderr strings.Builder
	sh.Stderr = &stderr
	if err := sh.Start(); err != nil {
		t.Fatal(err)
	}
	defer sh.Process.Kill()
	waitForFile(ctx, t, filepath.Join(a, "streamer-capture.sock"))
	if err := RunCRIU(ctx, t, "dump", "--stream", "-D", a, "-t", strconv.Itoa(tg.PID()), "-o", "dump.log", "-v4"); err != nil {
		t.Fatalf("criu dump: %v; pipeline: %s", err, stderr.String())
	}
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatal(err)
	}
	waitForFile(ctx, t, filepath.Join(b, "streamer-serve.sock"))
	if err := RunCRIU(ctx, t, "restore", "--stream", "-D", b, "--restore-detached", "-o", "restore.log", "-v4"); err != nil {
		t.Fatalf("criu restore: %v; pipeline: %s", err, stderr.String())
	}
	if err := sh.Wait(); err != nil {
		t.Fatalf("pipeline: %v: %s", err, stderr.String())
	}
	provenRestore(ctx, t, tg, before)
}
