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

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/cisformat/cisformattest"
)

const fixtureDir = "../../cisformat/testdata"

// openFixture opens a fixture for a descriptor flag. (A pipe made with
// os.Pipe would be in Go's poller twice once the command wraps its fd; the
// e2e tests feed real pipes.)
func openFixture(t *testing.T, file string) *os.File {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// handOver returns a descriptor of f's file for the command to own: it
// closes the descriptors it is given, as the real process does, and must
// not close one that f still owns (its number could be reused, and f would
// then close someone else's file).
func handOver(t *testing.T, f *os.File) int {
	t.Helper()
	fd, err := unix.Dup(int(f.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	unix.CloseOnExec(fd)
	return fd
}

// TestExtractRealToolStreams: `extract` of each stream written by
// criu-image-streamer 1.0.0, driven with that tool's own options, writes
// the files its extract wrote, byte for byte, and its statistics line.
func TestExtractRealToolStreams(t *testing.T) {
	cases := []struct {
		name   string
		stdin  string
		shards []string
		tar    string
		ext    string
	}{
		{"stdin", "stream.img", nil, "stream.extracted.tar", ""},
		{"shard fds", "", []string{"shard0.img", "shard1.img"}, "shards.extracted.tar", ""},
		{"ext file", "stream-ext.img", nil, "stream-ext.extracted.tar", "extra.txt"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "img")
			if err := os.Mkdir(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			args := []string{"--images-dir", dir}
			var stdin io.Reader = strings.NewReader("")
			if c.stdin != "" {
				stdin = openFixture(t, filepath.Join(fixtureDir, c.stdin))
			}
			var want []int64
			var fds []string
			for _, s := range c.shards {
				fds = append(fds, fmt.Sprint(handOver(t, openFixture(t, filepath.Join(fixtureDir, s)))))
				fi, _ := os.Stat(filepath.Join(fixtureDir, s))
				want = append(want, fi.Size())
			}
			if c.stdin != "" {
				fi, _ := os.Stat(filepath.Join(fixtureDir, c.stdin))
				want = append(want, fi.Size())
			}
			if fds != nil {
				args = append(args, "--shard-fds", strings.Join(fds, ","))
			}
			var extOut *os.File
			if c.ext != "" {
				extPath := filepath.Join(t.TempDir(), "ext.out")
				f, err := os.Create(extPath)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { f.Close() })
				extOut = f
				args = append(args, "--ext-file-fds", fmt.Sprintf("%s:%d", c.ext, handOver(t, f)))
			}
			args = append(args, "extract")
			var stdout, stderr bytes.Buffer
			if err := run(context.Background(), args, stdin, &stdout, &stderr); err != nil {
				t.Fatalf("extract: %v\n%s", err, stderr.String())
			}
			for name, b := range cisformattest.Extracted(t, filepath.Join(fixtureDir, c.tar)) {
				got, err := os.ReadFile(filepath.Join(dir, name))
				if err != nil || !bytes.Equal(got, b) {
					t.Errorf("%s: %d bytes (%v), the real tool wrote %d", name, len(got), err, len(b))
				}
			}
			if extOut != nil {
				got, _ := os.ReadFile(extOut.Name())
				wantExt, _ := os.ReadFile(filepath.Join(fixtureDir, c.ext))
				if !bytes.Equal(got, wantExt) {
					t.Errorf("ext file: %q, want %q", got, wantExt)
				}
			}
			var st checkpoint.Stats
			if err := json.Unmarshal(bytes.TrimSpace(stderr.Bytes()), &st); err != nil {
				t.Fatalf("statistics line: %v in %q", err, stderr.String())
			}
			if len(st.Shards) != len(want) {
				t.Fatalf("%d shards in %+v, want %d", len(st.Shards), st, len(want))
			}
			for i, s := range st.Shards {
				if s.Size != want[i] {
					t.Errorf("shard %d: size %d, the stream holds %d bytes", i, s.Size, want[i])
				}
			}
		})
	}
}

// TestExtractDamagedRealToolStream: a truncated stream exits 3 naming
// where.
func TestExtractDamagedRealToolStream(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(fixtureDir, "stream.img"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	var stdout, stderr bytes.Buffer
	err = run(context.Background(), []string{"--images-dir", dir, "extract"}, bytes.NewReader(b[:60000]), &stdout, &stderr)
	if code := exitCode(err, false); code != exitCorrupt {
		t.Fatalf("exit %d (%v), want %d", code, err, exitCorrupt)
	}
	if !strings.Contains(err.Error(), "stdin at offset") {
		t.Errorf("error does not say where: %v", err)
	}
}

// TestConnectTimeoutMessage: capture and serve stop waiting for a criu that
// never comes, naming the socket and the flag.
func TestConnectTimeoutMessage(t *testing.T) {
	stream := filepath.Join(fixtureDir, "stream.img")
	for _, c := range []struct {
		cmd    string
		socket string
	}{{"capture", "streamer-capture.sock"}, {"serve", "streamer-serve.sock"}} {
		t.Run(c.cmd, func(t *testing.T) {
			dir, err := os.MkdirTemp("/tmp", "gct-")
			if err != nil {
				t.Fatal(err)
			}
			defer os.RemoveAll(dir)
			args := []string{"--images-dir", dir, "--connect-timeout", "300ms", c.cmd}
			if c.cmd == "serve" {
				args = append(args, "--from", stream)
			}
			var stdout, stderr bytes.Buffer
			err = run(context.Background(), args, strings.NewReader(""), &stdout, &stderr)
			if err == nil {
				t.Fatal("no error")
			}
			for _, want := range []string{filepath.Join(dir, c.socket), "--connect-timeout", "300ms"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("%q does not name %q", err, want)
				}
			}
		})
	}
}

// TestImagesDirCreated: a missing --images-dir is created, private, as the
// real tool creates it (of any length: the sockets are bound through a
// descriptor of it, criusock/dirsock.go).
func TestImagesDirCreated(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a", "img")
	var stdout, stderr bytes.Buffer
	b, err := os.ReadFile(filepath.Join(fixtureDir, "stream.img"))
	if err != nil {
		t.Fatal(err)
	}
	if err := run(context.Background(), []string{"--images-dir", dir, "extract"}, bytes.NewReader(b), &stdout, &stderr); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(dir)
	if err != nil || st.Mode().Perm() != 0o700 {
		t.Fatalf("images dir: %v %v, want mode 0700", st.Mode(), err)
	}
}

// TestRealToolOptions: criu-image-streamer's options, short and long, as
// its drivers write them (before the command).
func TestRealToolOptions(t *testing.T) {
	stream := filepath.Join(fixtureDir, "stream.img")
	tests := []struct {
		name   string
		args   []string
		code   int
		stdout string
		err    string
	}{
		{"--version", []string{"--version"}, exitOK, "gpucr-stream " + version + "\n", ""},
		{"-V", []string{"-V"}, exitOK, "gpucr-stream " + version + "\n", ""},
		{"-V with a command", []string{"-D", "/tmp/x", "-V", "capture"}, exitOK, "gpucr-stream " + version + "\n", ""},
		{"-D -p extract", []string{"-D", "DIR", "-p", "1", "extract", "--from", stream}, exitOK, `{"shards":[{"size":119675,`, ""},
		{"-s on a command without shards", []string{"-s", "4", "checkpoint", "--pid", "1"}, exitUsage, "", "checkpoint does not take --shard-fds"},
		{"-e NAME:FD", []string{"-D", "DIR", "-e", "nocolon", "extract"}, exitUsage, "", "NAME:FD"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			args := append([]string(nil), tc.args...)
			for i, a := range args {
				if a == "DIR" {
					args[i] = dir
				}
			}
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), args, strings.NewReader(""), &stdout, &stderr)
			if code := exitCode(err, false); code != tc.code {
				t.Fatalf("exit %d (%v), want %d", code, err, tc.code)
			}
			if tc.code == exitOK && !strings.HasPrefix(stdout.String(), tc.stdout) {
				t.Errorf("stdout %q, want it to start with %q", stdout.String(), tc.stdout)
			}
			if tc.err != "" && !strings.Contains(err.Error(), tc.err) {
				t.Errorf("error %q lacks %q", err, tc.err)
			}
		})
	}
}
