package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/capture"
)

func TestMigrateUsage(t *testing.T) {
	dir := t.TempDir()
	tok := filepath.Join(dir, "tok")
	if err := os.WriteFile(tok, []byte("0123456789abcdef0123456789abcdef\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		args    []string
		code    int
		errText string
	}{
		{[]string{"migrate", "--to", "tcp://127.0.0.1:1"}, exitUsage, "--pid"},
		{[]string{"migrate", "--pid", "1", "--to", "/tmp/x"}, exitUsage, "tcp://HOST:PORT"},
		{[]string{"migrate", "--pid", "1", "--to", "tcp://127.0.0.1:1"}, exitUsage, "--token-file"},
		{[]string{"migrate", "--pid", "1", "--to", "tcp://127.0.0.1:1", "--token-file", tok, "--streams", "0"}, exitUsage, "--streams"},
		{[]string{"migrate", "--pid", "1", "--to", "tcp://127.0.0.1:1", "--token-file", tok, "--net-timeout", "1ms"}, exitUsage, "--net-timeout"},
		{[]string{"migrate", "--pid", "1", "--to", "tcp://127.0.0.1:1", "--tls-cert", "c.pem"}, exitUsage, "all of --tls-cert"},
		{[]string{"receive", "--restore"}, exitUsage, "--listen"},
		{[]string{"receive", "--listen", "127.0.0.1:0"}, exitUsage, "--token-file"},
		{[]string{"receive", "--listen", "127.0.0.1:0", "--token-file", tok}, exitUsage, "--images-dir"},
		{[]string{"capture", "--images-dir", dir, "--to", "tcp://127.0.0.1:1"}, exitUsage, "--token-file"},
		{[]string{"token", "extra"}, exitUsage, "token > FILE"},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			_, errOut, code := runCmd(t, tc.args...)
			if code != tc.code || !strings.Contains(errOut, tc.errText) {
				t.Fatalf("exit %d, %q; want %d and %q", code, errOut, tc.code, tc.errText)
			}
		})
	}
	out, _, code := runCmd(t, "token")
	if code != 0 || len(strings.TrimSpace(out)) != 64 {
		t.Fatalf("token: %q %d", out, code)
	}
	help, _, _ := runCmd(t, "--help")
	for _, want := range []string{"migrate", "receive", "$GPUCR_TOKEN_FILE", "--streams"} {
		if !strings.Contains(help, want) {
			t.Errorf("help lacks %s", want)
		}
	}
}

// lineWriter hands stderr lines to a channel.
func lineWriter(ch chan<- string) io.WriteCloser {
	r, w := io.Pipe()
	go func() {
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			ch <- sc.Text()
		}
	}()
	return w
}

// TestCaptureExtractTCP runs capture --to tcp:// against extract --from
// tcp:// in one process, with a producer in place of CRIU: the files come
// out whole on the other side, and a sender with the wrong token is
// refused before it takes any image.
func TestCaptureExtractTCP(t *testing.T) {
	dir := t.TempDir()
	tok := filepath.Join(dir, "tok")
	bad := filepath.Join(dir, "bad")
	os.WriteFile(tok, []byte("0123456789abcdef0123456789abcdef\n"), 0o600)
	os.WriteFile(bad, []byte("fedcba9876543210fedcba9876543210\n"), 0o600)
	a, err := os.MkdirTemp("", "gcs-a-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(a)
	b := filepath.Join(dir, "b")
	os.Mkdir(b, 0o755)
	src := filepath.Join(dir, "src")
	os.Mkdir(src, 0o755)
	files := map[string][]byte{"pages-1.img": make([]byte, 9<<20+7), "core-1.img": []byte("core"), "inventory.img": []byte("inv")}
	rand.Read(files["pages-1.img"][:5<<20])
	for n, d := range files {
		os.WriteFile(filepath.Join(src, n), d, 0o644)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	lines := make(chan string, 64)
	stderr := lineWriter(lines)
	extracted := make(chan error, 1)
	go func() {
		extracted <- run(ctx, []string{"extract", "--from", "tcp://" + addr, "--images-dir", b, "--token-file", tok, "--net-timeout", "3s"},
			strings.NewReader(""), io.Discard, stderr)
	}()
	for l := range lines {
		if strings.Contains(l, "listening on") {
			break
		}
	}
	go func() {
		for range lines {
		}
	}()
	var errOut bytes.Buffer
	err = run(ctx, []string{"capture", "--images-dir", a, "--to", "tcp://" + addr, "--token-file", bad}, strings.NewReader(""), io.Discard, &errOut)
	if err == nil || !strings.Contains(err.Error(), "token does not match") {
		t.Fatalf("capture with the wrong token: %v", err)
	}
	captured := make(chan error, 1)
	go func() {
		captured <- run(ctx, []string{"capture", "--images-dir", a, "--to", "tcp://" + addr, "--token-file", tok, "--streams", "3", "--progress-fd", "1"},
			strings.NewReader(""), io.Discard, &errOut)
	}()
	// The socket file appears at bind, a moment before listen: retry.
	var c *capture.Client
	for {
		if c, err = capture.Dial(ctx, a); err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n, err := c.PushDir(ctx, src); err != nil || n != len(files) {
		t.Fatalf("push: %d %v", n, err)
	}
	c.Close()
	if err := <-captured; err != nil {
		t.Fatalf("capture: %v: %s", err, errOut.String())
	}
	if err := <-extracted; err != nil {
		t.Fatalf("extract: %v", err)
	}
	for n, want := range files {
		got, err := os.ReadFile(filepath.Join(b, n))
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%s: %d bytes, %v", n, len(got), err)
		}
	}
}
