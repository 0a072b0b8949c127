package e2e

// The drop-in tests drive gpucr-stream exactly as scripts and CRIU's own
// tooling drive criu-image-streamer 1.0.0: through a two-line wrapper named
// criu-image-streamer, its short options before the command, and its
// progress lines read strictly in its order, each the next line or the test
// fails (a driver that reads one line and waits for another hangs on any
// other order).

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/cisformat"
)

// dropInWrapper writes the two-line criu-image-streamer wrapper and
// returns its path.
func dropInWrapper(t testing.TB) string {
	t.Helper()
	bin, err := filepath.Abs(BuildBinary(t, "./cmd/gpucr-stream"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	p := filepath.Join(dir, "criu-image-streamer")
	script := fmt.Sprintf("#!/bin/sh\nexec %s \"$@\"\n", bin)
	if err := os.WriteFile(p, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// driven is a criu-image-streamer run by a driver: progress on fd 3.
type driven struct {
	t      testing.TB
	name   string
	cmd    *exec.Cmd
	lines  *bufio.Scanner
	pr     *os.File
	stderr bytes.Buffer
}

// drive starts `criu-image-streamer -D images -p 3 ARGS...` (options
// before the command, as the real tool's drivers write them).
func drive(t testing.TB, wrapper, images string, stdin io.Reader, stdout io.Writer, extra []*os.File, args ...string) *driven {
	t.Helper()
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	full := append([]string{"-D", images, "-p", "3"}, args...)
	d := &driven{t: t, name: "criu-image-streamer " + strings.Join(full, " "), pr: pr}
	d.cmd = exec.Command(wrapper, full...)
	d.cmd.Stdin, d.cmd.Stdout, d.cmd.Stderr = stdin, stdout, &d.stderr
	d.cmd.ExtraFiles = append([]*os.File{pw}, extra...)
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pw.Close()
	d.lines = bufio.NewScanner(pr)
	t.Cleanup(func() {
		d.cmd.Process.Kill()
		d.cmd.Wait()
		pr.Close()
	})
	return d
}

// next reads the next progress line; it must be want (or, with want "{",
// a statistics line, which it returns decoded).
func (d *driven) next(want string) stats {
	d.t.Helper()
	if !d.lines.Scan() {
		err := d.cmd.Wait()
		d.t.Fatalf("%s: progress ended waiting for %q (exit: %v; stderr: %s)", d.name, want, err, d.stderr.String())
	}
	line := d.lines.Text()
	if want != "{" {
		if line != want {
			d.t.Fatalf("%s: progress line %q, the real tool writes %q here", d.name, line, want)
		}
		return stats{}
	}
	var st stats
	if err := json.Unmarshal([]byte(line), &st); err != nil || len(st.Shards) == 0 {
		d.t.Fatalf("%s: progress line %q, the real tool writes its statistics here (%v)", d.name, line, err)
	}
	return st
}

// end waits for the exit and checks no progress line follows.
func (d *driven) end() {
	d.t.Helper()
	if d.lines.Scan() {
		d.t.Errorf("%s: unexpected progress line %q after the last", d.name, d.lines.Text())
	}
	if err := d.cmd.Wait(); err != nil {
		d.t.Fatalf("%s: %v; stderr: %s", d.name, err, d.stderr.String())
	}
}

type stats struct {
	Shards []struct {
		Size           int64 `json:"size"`
		TransferMillis int64 `json:"transfer_duration_millis"`
	} `json:"shards"`
	StoredBytes int64 `json:"stored_bytes"`
}

func (s stats) sizes() []int64 {
	var out []int64
	for _, sh := range s.Shards {
		out = append(out, sh.Size)
	}
	return out
}

// TestDropInVersion: how tools check that a streamer is installed.
func TestDropInVersion(t *testing.T) {
	w := dropInWrapper(t)
	for _, flag := range []string{"--version", "-V"} {
		out, err := exec.Command(w, flag).CombinedOutput()
		if err != nil || !strings.HasPrefix(string(out), "gpucr-stream ") || strings.Count(string(out), "\n") != 1 {
			t.Errorf("criu-image-streamer %s: %q, %v; want one line \"gpucr-stream VERSION\", exit 0", flag, out, err)
		}
	}
}

// TestDropInCaptureServeExtract: capture a real dump through the wrapper,
// serve it to a real restore, extract it; every progress line in the real
// tool's order; stats sizes are the stream's bytes.
func TestDropInCaptureServeExtract(t *testing.T) {
	CRIU(t)
	w := dropInWrapper(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 64)

	streamPath := filepath.Join(dir, "img.stream")
	out, err := os.Create(streamPath)
	if err != nil {
		t.Fatal(err)
	}
	a := filepath.Join(dir, "a") // the real tool creates it
	capture := drive(t, w, a, nil, out, nil, "capture")
	capture.next("socket-init")
	dumpErr := make(chan error, 1)
	go func() {
		dumpErr <- RunCRIU(ctx, t, "dump", "--stream", "-D", a, "-t", strconv.Itoa(tg.PID()), "-o", "dump.log", "-v4")
	}()
	capture.next("checkpoint-start")
	capSt := capture.next("{")
	capture.end()
	out.Close()
	if err := <-dumpErr; err != nil {
		t.Fatal(err)
	}
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(streamPath)
	if err != nil {
		t.Fatal(err)
	}
	if got := capSt.sizes(); len(got) != 1 || got[0] != fi.Size() {
		t.Errorf("capture stats sizes %v, the stream holds %d bytes", got, fi.Size())
	}

	in, err := os.Open(streamPath)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	b := filepath.Join(dir, "b")
	serve := drive(t, w, b, in, nil, nil, "serve")
	serveSt := serve.next("{") // the whole stream is read first
	if got := serveSt.sizes(); len(got) != 1 || got[0] != fi.Size() || serveSt.StoredBytes == 0 {
		t.Errorf("serve stats %+v: want size %d (the stream's bytes) and stored_bytes", serveSt, fi.Size())
	}
	serve.next("socket-init") // only then it listens
	if err := RunCRIU(ctx, t, "restore", "--stream", "-D", b, "--restore-detached", "-o", "restore.log", "-v4"); err != nil {
		t.Fatalf("restore: %v (serve stderr: %s)", err, serve.stderr.String())
	}
	serve.end()
	provenRestore(ctx, t, tg, before)
	tg.Kill()

	in2, err := os.Open(streamPath)
	if err != nil {
		t.Fatal(err)
	}
	defer in2.Close()
	c := filepath.Join(dir, "c")
	extract := drive(t, w, c, in2, nil, nil, "extract")
	exSt := extract.next("{")
	extract.end()
	if got := exSt.sizes(); len(got) != 1 || got[0] != fi.Size() {
		t.Errorf("extract stats sizes %v, want [%d]", got, fi.Size())
	}
	if _, err := os.Stat(filepath.Join(c, "inventory.img")); err != nil {
		t.Errorf("extract wrote no inventory.img: %v", err)
	}
}

// TestDropInServeRealToolStream: a stream in criu-image-streamer's own
// format, of a real dump, served to a real restore through the wrapper.
// The stream is written here from `criu dump -D` files the way that tool
// writes it (files interleaved, markers over two shards by seq), since the
// real tool is not installed here; testdata/ holds streams it wrote itself.
func TestDropInServeRealToolStream(t *testing.T) {
	CRIU(t)
	w := dropInWrapper(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 32)
	images := mkdir(t, filepath.Join(dir, "img"))
	if err := RunCRIU(ctx, t, "dump", "-D", images, "-t", strconv.Itoa(tg.PID()), "-o", "dump.log", "-v4"); err != nil {
		t.Fatal(err)
	}
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatal(err)
	}
	shards := legacyStream(t, images, 2)
	var files []*os.File
	for i, sh := range shards {
		p := filepath.Join(dir, fmt.Sprintf("shard%d.img", i))
		if err := os.WriteFile(p, sh, 0o600); err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		files = append(files, f)
	}
	b := filepath.Join(dir, "b")
	// ExtraFiles after the progress pipe (fd 3): fds 4 and 5.
	serve := drive(t, w, b, nil, nil, files, "-s", "4,5", "serve")
	st := serve.next("{")
	if got := st.sizes(); len(got) != 2 || got[0] != int64(len(shards[0])) || got[1] != int64(len(shards[1])) {
		t.Errorf("serve stats sizes %v, want [%d %d]", got, len(shards[0]), len(shards[1]))
	}
	serve.next("socket-init")
	if err := RunCRIU(ctx, t, "restore", "--stream", "-D", b, "--restore-detached", "-o", "restore.log", "-v4"); err != nil {
		t.Fatalf("restore: %v (serve stderr: %s)", err, serve.stderr.String())
	}
	serve.end()
	provenRestore(ctx, t, tg, before)
	tg.Kill()
}

// legacyStream writes the files of dir as criu-image-streamer 1.0.0 would:
// 64 KiB chunks of the files taken in turn (so files interleave and the
// filename marker is repeated on every switch), markers dealt to the shards
// round-robin by seq, inventory.img last.
func legacyStream(t *testing.T, dir string, nshards int) [][]byte {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		if e.Type().IsRegular() && strings.HasSuffix(e.Name(), ".img") && e.Name() != "inventory.img" && e.Name() != "stats-dump" {
			names = append(names, e.Name())
		}
	}
	sort.Strings(names)
	names = append(names, "inventory.img")
	contents := map[string][]byte{}
	for _, n := range names {
		b, err := os.ReadFile(filepath.Join(dir, n))
		if err != nil {
			t.Fatal(err)
		}
		contents[n] = b
	}
	shards := make([][]byte, nshards)
	var seq uint64
	emit := func(m cisformat.Marker, data []byte) {
		m.Seq = seq
		i := int(seq) % nshards
		shards[i] = cisformat.AppendMarker(shards[i], m)
		shards[i] = append(shards[i], data...)
		seq++
	}
	// All but inventory.img open at once and take turns.
	open := names[:len(names)-1]
	offs := map[string]int{}
	for len(open) > 0 {
		var still []string
		for _, n := range open {
			emit(cisformat.Marker{Kind: cisformat.Filename, Name: n}, nil)
			if k := min(64<<10, len(contents[n])-offs[n]); k > 0 {
				emit(cisformat.Marker{Kind: cisformat.FileData, Size: uint32(k)}, contents[n][offs[n]:offs[n]+k])
				offs[n] += k
			}
			if offs[n] == len(contents[n]) {
				emit(cisformat.Marker{Kind: cisformat.FileEOF}, nil)
			} else {
				still = append(still, n)
			}
		}
		open = still
	}
	inv := contents["inventory.img"]
	emit(cisformat.Marker{Kind: cisformat.Filename, Name: "inventory.img"}, nil)
	emit(cisformat.Marker{Kind: cisformat.FileData, Size: uint32(len(inv))}, inv)
	emit(cisformat.Marker{Kind: cisformat.FileEOF}, nil)
	emit(cisformat.Marker{Kind: cisformat.ImageEOF}, nil)
	return shards
}
