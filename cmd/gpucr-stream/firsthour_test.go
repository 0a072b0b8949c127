package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/miniotest"
	"github.com/gpucr/gpucr-stream/streamer"
)

// TestFirstHour: what a new user ran into in the first hour, as table
// cases of the command line.
func TestFirstHour(t *testing.T) {
	tests := []struct {
		name string
		args []string
		code int
		err  string
	}{
		{"checkpoint of a process that does not exist", []string{"checkpoint", "--pid", "999999999", "--to", "DIR/ck"}, exitNotFound, "no process 999999999"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			args := append([]string(nil), tc.args...)
			for i := range args {
				args[i] = strings.ReplaceAll(args[i], "DIR", dir)
			}
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), args, strings.NewReader(""), &stdout, &stderr)
			if code := exitCode(err, false); code != tc.code {
				t.Fatalf("exit %d (%v), want %d", code, err, tc.code)
			}
			if tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
				t.Errorf("error %v lacks %q", err, tc.err)
			}
		})
	}
}

// openPTY returns the terminal side of a new pseudo-terminal.
func openPTY(t *testing.T) *os.File {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatalf("no pseudo-terminal: %v", err)
	}
	t.Cleanup(func() { m.Close() })
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	s, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// TestRefuseTerminal: a binary stream is not written to a terminal
// (capture, checkpoint); elsewhere, or with --to, the same commands go on.
func TestRefuseTerminal(t *testing.T) {
	tty := openPTY(t)
	dir := t.TempDir()
	tests := []struct {
		name   string
		args   []string
		stdout *os.File
		code   int
	}{
		{"capture to a terminal", []string{"--images-dir", dir + "/a", "capture"}, tty, exitUsage},
		{"checkpoint to a terminal", []string{"checkpoint", "--pid", fmt.Sprint(os.Getpid())}, tty, exitUsage},
		{"capture --to a dir, terminal stdout", []string{"--images-dir", dir + "/b", "--connect-timeout", "100ms", "capture", "--to", dir + "/ck"}, tty, exitFailure},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var stderr bytes.Buffer
			err := run(context.Background(), tc.args, strings.NewReader(""), tc.stdout, &stderr)
			if code := exitCode(err, false); code != tc.code {
				t.Fatalf("exit %d (%v), want %d", code, err, tc.code)
			}
			if tc.code == exitUsage && !strings.Contains(err.Error(), "terminal") {
				t.Errorf("error %q does not say why", err)
			}
		})
	}
	if _, err := os.Stat(dir + "/a"); err == nil {
		t.Error("the refused capture created its images dir")
	}
}

// TestEmptyStdinIsUsage: restore, inspect and verify with no SRC and an
// empty standard input (/dev/null, an empty file, a pipe closed with
// nothing in it: a script or a job scheduler's) are a usage error naming
// SRC, not corrupt data; a pipe that holds bytes is read, and judged by
// them.
func TestEmptyStdinIsUsage(t *testing.T) {
	empty := filepath.Join(t.TempDir(), "empty")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	pipe := func(data string) *os.File {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		w.WriteString(data)
		w.Close()
		t.Cleanup(func() { r.Close() })
		return r
	}
	open := func(p string) *os.File {
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	for _, cmd := range [][]string{{"restore"}, {"inspect"}, {"verify"}, {"restore", "--from", "-"}} {
		for _, tc := range []struct {
			name  string
			stdin func() *os.File
			code  int
		}{
			{"/dev/null", func() *os.File { return open(os.DevNull) }, exitUsage},
			{"empty file", func() *os.File { return open(empty) }, exitUsage},
			{"closed empty pipe", func() *os.File { return pipe("") }, exitUsage},
			{"pipe of garbage", func() *os.File { return pipe("no stream") }, exitCorrupt},
		} {
			if tc.code == exitCorrupt && cmd[0] == "restore" {
				continue // it would start CRIU
			}
			t.Run(strings.Join(cmd, " ")+", "+tc.name, func(t *testing.T) {
				var stderr bytes.Buffer
				err := run(context.Background(), cmd, tc.stdin(), io.Discard, &stderr)
				if code := exitCode(err, false); code != tc.code {
					t.Fatalf("exit %d (%v), want %d", code, err, tc.code)
				}
				if tc.code == exitUsage && !strings.Contains(err.Error(), "needs SRC: standard input is empty") {
					t.Errorf("error %q does not say SRC is missing", err)
				}
			})
		}
	}
}

// TestRefuseNoCopy: a checkpoint whose only copy would go to /dev/null is
// refused before anything runs (a process that does not exist is not even
// looked for); a file or a pipe on standard output is a copy.
func TestRefuseNoCopy(t *testing.T) {
	null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	file, err := os.Create(filepath.Join(t.TempDir(), "ck.stream"))
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	checkpoint := []string{"checkpoint", "--pid", "999999999"}
	tests := []struct {
		name   string
		args   []string
		stdout *os.File
		code   int
		err    string
	}{
		{"no --to, stdout /dev/null", checkpoint, null, exitUsage, "refusing to checkpoint into /dev/null (standard output)"},
		{"--to -, stdout /dev/null", append(checkpoint, "--to", "-"), null, exitUsage, "kept nowhere"},
		{"stdout a file", checkpoint, file, exitNotFound, "no process 999999999"},
		{"stdout a pipe", checkpoint, w, exitNotFound, "no process 999999999"},
		{"--to a dir, stdout /dev/null", append(checkpoint, "--to", t.TempDir()+"/ck"), null, exitNotFound, "no process 999999999"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var stderr bytes.Buffer
			err := run(context.Background(), tc.args, strings.NewReader(""), tc.stdout, &stderr)
			if code := exitCode(err, false); code != tc.code || !strings.Contains(fmt.Sprint(err), tc.err) {
				t.Fatalf("exit %d (%v), want %d and %q", code, err, tc.code, tc.err)
			}
		})
	}
}

// TestSmallerFirstHour: verify --json says failures in JSON; inspect on a
// terminal stdin is a usage error; a bad $GPUCR_CODEC is named as such and
// does not break a command that does not encode.
func TestSmallerFirstHour(t *testing.T) {
	dir := t.TempDir()
	b, err := os.ReadFile(filepath.Join(fixtureDir, "stream.img"))
	if err != nil {
		t.Fatal(err)
	}
	damaged := filepath.Join(dir, "damaged.stream")
	if err := os.WriteFile(damaged, b[:50000], 0o644); err != nil {
		t.Fatal(err)
	}
	good := filepath.Join(dir, "good.stream")
	if err := os.WriteFile(good, b, 0o644); err != nil {
		t.Fatal(err)
	}
	tty := openPTY(t)
	tests := []struct {
		name   string
		env    string // GPUCR_CODEC
		args   []string
		stdin  *os.File
		code   int
		stdout string
		err    string
	}{
		{"verify --json, damaged", "", []string{"verify", "--json", damaged}, nil, exitCorrupt, `"ok":false`, "offset"},
		{"verify --json, intact", "", []string{"verify", "--json", good}, nil, exitOK, `"ok":true`, ""},
		{"inspect, terminal stdin", "", []string{"inspect"}, tty, exitUsage, "", "inspect needs SRC"},
		{"verify, terminal stdin", "", []string{"verify"}, tty, exitUsage, "", "verify needs SRC"},
		{"bad $GPUCR_CODEC, verify", "brotli", []string{"verify", good}, nil, exitOK, "ok:", ""},
		{"bad $GPUCR_CODEC, capture", "brotli", []string{"--images-dir", dir + "/img", "capture", "--to", dir + "/ck"}, nil, exitUsage, "", "$GPUCR_CODEC"},
		{"bad --codec, verify", "", []string{"verify", "--codec", "brotli", good}, nil, exitUsage, "", "--codec"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.env != "" {
				t.Setenv("GPUCR_CODEC", tc.env)
			}
			var stdin io.Reader = strings.NewReader("")
			if tc.stdin != nil {
				stdin = tc.stdin
			}
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), tc.args, stdin, &stdout, &stderr)
			if code := exitCode(err, false); code != tc.code {
				t.Fatalf("exit %d (%v), want %d", code, err, tc.code)
			}
			if !strings.Contains(stdout.String(), tc.stdout) {
				t.Errorf("stdout %q lacks %q", stdout.String(), tc.stdout)
			}
			if tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
				t.Errorf("error %v lacks %q", err, tc.err)
			}
		})
	}
}

// TestProcessInLsInspect: the checkpointed process's PID and command line,
// the checkpoint's id, and times with their zone, in ls and inspect alike.
func TestProcessInLsInspect(t *testing.T) {
	root := t.TempDir()
	ctx := context.Background()
	out, err := streamer.NewArchiveOutput(ctx, dir.New(filepath.Join(root, "job1")), 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: 64 << 10, Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.WriteFile("inventory.img", strings.NewReader("inv"), false); err != nil {
		t.Fatal(err)
	}
	created := time.Date(2026, 11, 25, 14, 0, 0, 0, time.FixedZone("X", 3600))
	m, err := c.Close(ctx, manifest.Manifest{Created: created, Process: &manifest.Process{PID: 4242, Cmdline: []string{"python", "train.py", "--epochs", "3"}}})
	if err != nil {
		t.Fatal(err)
	}
	if len(m.ID) != 32 {
		t.Errorf("manifest id %q, want 32 hex digits", m.ID)
	}
	lsOut, _, code := runCmd(t, "ls", root)
	if code != 0 {
		t.Fatalf("ls: exit %d", code)
	}
	inspOut, _, code := runCmd(t, "inspect", filepath.Join(root, "job1"))
	if code != 0 {
		t.Fatalf("inspect: exit %d", code)
	}
	for _, want := range []string{"2026-11-25T13:00:00Z", "4242", "python train.py --epochs 3"} {
		if !strings.Contains(lsOut, want) {
			t.Errorf("ls lacks %q:\n%s", want, lsOut)
		}
		if !strings.Contains(inspOut, want) {
			t.Errorf("inspect lacks %q:\n%s", want, inspOut)
		}
	}
	if !strings.Contains(inspOut, m.ID) {
		t.Errorf("inspect lacks the id %s:\n%s", m.ID, inspOut)
	}
	if !strings.Contains(inspOut, "format      3 (CRC-32C per chunk, no chunk hashes)") {
		t.Errorf("inspect does not say the format:\n%s", inspOut)
	}
}

// TestLsInspectAgree: ls and inspect give one checkpoint the same stored
// bytes, ratio and (deduplicated) new bytes, for a plain checkpoint and
// for two deduplicated ones, the second sharing the first's chunks.
func TestLsInspectAgree(t *testing.T) {
	root := t.TempDir()
	ctx := context.Background()
	loc := dir.New(root)
	data := bytes.Repeat([]byte("ls and inspect agree "), 100_000)
	capture := func(out streamer.Output) {
		c, err := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: 256 << 10, Workers: 2})
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range []string{"pages-1.img", "inventory.img"} {
			if _, err := c.WriteFile(n, bytes.NewReader(data), false); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
			t.Fatal(err)
		}
	}
	plain, err := streamer.NewArchiveOutput(ctx, store.Sub(loc, "plain"), 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	capture(plain)
	for _, name := range []string{"d1", "d2"} {
		out, err := streamer.NewDedupOutput(ctx, store.Sub(loc, name), loc, 1<<20, nil)
		if err != nil {
			t.Fatal(err)
		}
		capture(out)
	}
	items := lsNames(t, root)
	var lsed struct {
		NewBytes int64 `json:"new_bytes"`
	}
	for _, name := range []string{"plain", "d1", "d2"} {
		out, errOut, code := runCmd(t, "inspect", "--json", filepath.Join(root, name))
		if code != 0 {
			t.Fatalf("inspect %s: exit %d: %s", name, code, errOut)
		}
		var insp struct {
			Stats manifest.Stats `json:"stats"`
			Ratio float64        `json:"ratio"`
		}
		if err := json.Unmarshal([]byte(out), &insp); err != nil {
			t.Fatal(err)
		}
		ls := items[name]
		if ls.StoredBytes != insp.Stats.StoredBytes || ls.Ratio != insp.Ratio {
			t.Errorf("%s: ls says %d stored (%.3fx), inspect %d (%.3fx)", name, ls.StoredBytes, ls.Ratio, insp.Stats.StoredBytes, insp.Ratio)
		}
		lsOut, _, _ := runCmd(t, "ls", "--json", filepath.Join(root, name))
		var one []json.RawMessage
		if json.Unmarshal([]byte(lsOut), &one) != nil || len(one) != 1 || json.Unmarshal(one[0], &lsed) != nil {
			t.Fatalf("ls --json %s: %s", name, lsOut)
		}
		want := insp.Stats.StoredBytes
		if name != "plain" {
			want = insp.Stats.NewStoredBytes
		}
		if lsed.NewBytes != want {
			t.Errorf("%s: ls says %d new, inspect %d", name, lsed.NewBytes, want)
		}
	}
	if items["d2"].StoredBytes == 0 || lsed.NewBytes != 0 {
		t.Errorf("d2 repeats d1: stored %d, new %d; want its chunks stored and none new", items["d2"].StoredBytes, lsed.NewBytes)
	}
}

// TestMissingBucket: writing to a bucket that does not exist says how to
// make it; --create-bucket makes it; reading from one is "not found".
func TestMissingBucket(t *testing.T) {
	srv := miniotest.Start(t)
	for _, k := range []string{"AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3"} {
		t.Setenv(k, "")
	}
	t.Setenv("AWS_ENDPOINT_URL", srv.Endpoint())
	t.Setenv("AWS_ACCESS_KEY_ID", srv.AccessKey())
	t.Setenv("AWS_SECRET_ACCESS_KEY", srv.SecretKey())
	dir, err := os.MkdirTemp("/tmp", "gmb-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	_, errOut, code := runCmd(t, "--images-dir", dir, "capture", "--to", "s3://nobucket/job1")
	if code != exitNotFound || !strings.Contains(errOut, "--create-bucket") {
		t.Errorf("capture to a missing bucket: exit %d, %s", code, errOut)
	}
	_, errOut, code = runCmd(t, "verify", "s3://nobucket/job1")
	if code != exitNotFound || strings.Contains(errOut, "--create-bucket") {
		t.Errorf("verify from a missing bucket: exit %d, %s", code, errOut)
	}
	// Created, then the capture waits for CRIU (which does not come).
	_, errOut, code = runCmd(t, "--images-dir", dir, "--connect-timeout", "200ms", "capture", "--create-bucket", "--to", "s3://newbucket/job1")
	if code != exitFailure || !strings.Contains(errOut, "criu did not connect") {
		t.Errorf("capture --create-bucket: exit %d, %s", code, errOut)
	}
	_, errOut, code = runCmd(t, "ls", "s3://newbucket/")
	if code != exitOK {
		t.Errorf("ls of the created bucket: exit %d, %s", code, errOut)
	}
}

// TestCp: a checkpoint goes dir -> s3 -> dir, each copy verified; the last
// one verifies on its own; a copy onto itself is "already there".
func TestCp(t *testing.T) {
	srv := miniotest.Start(t)
	srv.MakeBucket(t, "cpb")
	for _, k := range []string{"AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3"} {
		t.Setenv(k, "")
	}
	t.Setenv("AWS_ENDPOINT_URL", srv.Endpoint())
	t.Setenv("AWS_ACCESS_KEY_ID", srv.AccessKey())
	t.Setenv("AWS_SECRET_ACCESS_KEY", srv.SecretKey())
	root := t.TempDir()
	writeArchive(t, dir.New(filepath.Join(root, "a")), "node1", 3<<20)
	steps := [][]string{
		{"cp", filepath.Join(root, "a"), "s3://cpb/fleet/job1"},
		{"cp", "s3://cpb/fleet/job1", filepath.Join(root, "b")},
		{"verify", filepath.Join(root, "b")},
		{"cp", filepath.Join(root, "a"), filepath.Join(root, "b")},
	}
	for _, s := range steps {
		out, errOut, code := runCmd(t, s...)
		if code != 0 {
			t.Fatalf("%v: exit %d: %s", s, code, errOut)
		}
		t.Logf("%v: %s", s, strings.TrimSpace(out))
	}
	out, _, _ := runCmd(t, "cp", filepath.Join(root, "a"), filepath.Join(root, "b"))
	if !strings.Contains(out, "already holds") {
		t.Errorf("second copy: %q", out)
	}
	if _, errOut, code := runCmd(t, "cp", filepath.Join(root, "nothing"), filepath.Join(root, "c")); code != exitNotFound {
		t.Errorf("cp of nothing: exit %d: %s", code, errOut)
	}
}

// TestNotFoundMessages: every command that reads a checkpoint or a
// location says the same of one that is not there: the command, the
// location, then what is missing (a directory, or a checkpoint in it),
// exit 4.
func TestNotFoundMessages(t *testing.T) {
	base := t.TempDir()
	missing, empty := filepath.Join(base, "missing"), filepath.Join(base, "empty")
	if err := os.Mkdir(empty, 0o755); err != nil {
		t.Fatal(err)
	}
	images := filepath.Join(base, "img")
	for _, tc := range []struct {
		cmd   string
		args  func(loc string) []string
		empty bool // also refuses an empty directory (ls, gc and check find nothing there)
	}{
		{"inspect", func(l string) []string { return []string{"inspect", l} }, true},
		{"verify", func(l string) []string { return []string{"verify", l} }, true},
		{"restore", func(l string) []string { return []string{"restore", "--criu", "/bin/true", l} }, true},
		{"serve", func(l string) []string { return []string{"--images-dir", images, "serve", "--from", l} }, true},
		{"extract", func(l string) []string { return []string{"--images-dir", images, "extract", "--from", l} }, true},
		{"cp", func(l string) []string { return []string{"cp", l, filepath.Join(base, "copy")} }, true},
		{"rm", func(l string) []string { return []string{"rm", l} }, true},
		{"ls", func(l string) []string { return []string{"ls", l} }, false},
		{"gc", func(l string) []string { return []string{"gc", l} }, false},
		{"check", func(l string) []string { return []string{"check", l} }, false},
	} {
		t.Run(tc.cmd, func(t *testing.T) {
			_, errOut, code := runCmd(t, tc.args(missing)...)
			if want := tc.cmd + ": " + missing + ": no such directory: not found"; code != exitNotFound || errOut != want {
				t.Errorf("missing directory: exit %d, %q; want exit %d, %q", code, errOut, exitNotFound, want)
			}
			if !tc.empty {
				return
			}
			_, errOut, code = runCmd(t, tc.args(empty)...)
			if want := tc.cmd + ": " + empty + ": no complete checkpoint there (manifest.json missing)"; code != exitNotFound || !strings.HasPrefix(errOut, want) {
				t.Errorf("empty directory: exit %d, %q; want exit %d, %q...", code, errOut, exitNotFound, want)
			}
		})
	}
}
