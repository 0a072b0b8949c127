package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/e2e"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/testwait"
)

func TestMigrateUsage(t *testing.T) {
	dir := t.TempDir()
	tok := filepath.Join(dir, "tok")
	if err := os.WriteFile(tok, []byte("f8d3e42278ffa37b89b6a07c63c048c94b109045490d663533f2f45cece573dd\n"), 0o600); err != nil {
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
		{[]string{"migrate", "--pid", "1", "--to", "tcp://127.0.0.1:1", "--token-file", tok, "--streams", "65"}, exitUsage, "--streams"},
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
	os.WriteFile(tok, []byte("f8d3e42278ffa37b89b6a07c63c048c94b109045490d663533f2f45cece573dd\n"), 0o600)
	os.WriteFile(bad, []byte("c42507a72743f066ab012986423285cf201791d5a42f4825b0927c4b4e2e9ecb\n"), 0o600)
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

	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
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
	var c *criusock.Client
	for {
		if c, err = criusock.Dial(ctx, a); err == nil {
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

// startReceiver runs receive on a free loopback port in the background and
// returns its address and, later, its outcome; stdout gets its output.
func startReceiver(ctx context.Context, t *testing.T, stdout io.Writer, args ...string) (string, <-chan error) {
	t.Helper()
	lines := make(chan string, 64)
	stderr := lineWriter(lines)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, append([]string{"receive", "--listen", "127.0.0.1:0"}, args...), strings.NewReader(""), stdout, stderr)
	}()
	for {
		select {
		case l := <-lines:
			if _, addr, ok := strings.Cut(l, "receive: listening on "); ok {
				go func() {
					for range lines {
					}
				}()
				return addr, done
			}
		case err := <-done:
			t.Fatalf("receive ended before listening: %v", err)
		}
	}
}

func writeToken(t *testing.T, dir string) string {
	t.Helper()
	tok := filepath.Join(dir, "tok")
	if err := os.WriteFile(tok, []byte("f8d3e42278ffa37b89b6a07c63c048c94b109045490d663533f2f45cece573dd\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return tok
}

// TestMigrateUndoesGPUStep runs migrate against a receiver in this process,
// with a fake CUDA driver and a fake criu whose dump fails at its start:
// after a suspend, a failed dump resumes the GPU state (restore, then
// unlock); a failed lock or GPU checkpoint is undone by the suspend itself
// and criu never runs. Either way the transfer is cancelled, the receiver
// restores nothing and the sender keeps no copy.
func TestMigrateUndoesGPUStep(t *testing.T) {
	dir := t.TempDir()
	tok := writeToken(t, dir)
	criuLog := filepath.Join(dir, "criu-calls")
	fakeCRIU := filepath.Join(dir, "criu")
	script := "#!/bin/sh\n[ \"$1\" = --version ] && { echo 'Version: 4.1'; exit 0; }\necho \"$1\" >>" + criuLog +
		"\necho 'Error (criu/cr-dump.c:1): fake criu refuses to dump' >&2\nexit 1\n"
	if err := os.WriteFile(fakeCRIU, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	// The target is this test process: nothing touches it but the fakes.
	pid := os.Getpid()
	cases := []struct {
		name, failOn, cuda string
		calls              string // the driver calls, P for the pid
		criuRuns           bool
		errText            string // {pid} for the pid
	}{
		{"dump-fails", "", "auto", "lock P, checkpoint P, restore P, unlock P", true, "GPU state of [{pid}] restored and unlocked"},
		{"undo-fails", "restore", "auto", "lock P, checkpoint P, restore P, unlock P", true, "undoing the GPU step of [{pid}] failed too"},
		{"lock-fails", "lock", "auto", "lock P", false, "lock"},
		{"checkpoint-fails", "checkpoint", "auto", "lock P, checkpoint P, unlock P", false, "checkpoint"},
		{"cuda-off", "", "off", "", true, "fake criu refuses"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
			defer cancel()
			os.Remove(criuLog)
			f := withFakeCUDA(t, pid)
			if c.failOn != "" {
				f.FailOn[c.failOn] = true
			}
			keep := t.TempDir()
			addr, received := startReceiver(ctx, t, io.Discard, "--restore", "--criu", fakeCRIU, "--token-file", tok, "--net-timeout", "3s")
			_, err := runGPUCmd(ctx, "migrate", "--pid", strconv.Itoa(pid), "--to", "tcp://"+addr, "--token-file", tok,
				"--criu", fakeCRIU, "--cuda", c.cuda, "--keep-dir", keep, "--net-timeout", "3s")
			if err == nil {
				t.Fatal("migrate succeeded")
			}
			p := strconv.Itoa(pid)
			for _, want := range []string{strings.ReplaceAll(c.errText, "{pid}", p), "not migrated and keeps running here"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("migrate error lacks %q: %v", want, err)
				}
			}
			if got, want := f.Log(), strings.ReplaceAll(c.calls, "P", p); got != want {
				t.Errorf("driver calls %q, want %q", got, want)
			}
			if st := f.States[pid]; c.failOn != "restore" && st != cudadriver.StateRunning {
				t.Errorf("GPU state left %s", st)
			}
			// The receiver's criu restore starts once the sender connects:
			// only the dump counts.
			calls, _ := os.ReadFile(criuLog)
			if dumped := slices.Contains(strings.Fields(string(calls)), "dump"); dumped != c.criuRuns {
				t.Errorf("criu dump ran: %v, want %v (calls %q)", dumped, c.criuRuns, calls)
			}
			if ents, _ := os.ReadDir(keep); len(ents) > 0 {
				t.Errorf("a failed migrate left %s in the keep dir", ents[0].Name())
			}
			if rerr := <-received; rerr == nil {
				t.Error("the receiver restored a cancelled migration")
			}
		})
	}
}

// TestMigrateCUDA migrates a real process with real CRIU to a receive
// --restore in this process (one host, so the process comes back with
// its PIDs), with a fake CUDA driver: the sender suspends the GPU state
// before the dump, the GPUs it records travel with the commit, and the
// receiver restores and unlocks the restored process. When the receiver's
// GPU restore fails, the sender hears it and keeps its copy.
func TestMigrateCUDA(t *testing.T) {
	criu := e2e.CRIU(t)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(3*time.Minute))
	defer cancel()
	dir := e2e.ShortTempDir(t)
	tok := writeToken(t, dir)
	tg := e2e.StartTarget(t, filepath.Join(dir, "target"), 32)
	before, err := tg.Prove(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pid := strconv.Itoa(tg.PID())
	// migrate waits until the dumped target is reaped, which its parent
	// (this process) does in the background.
	migrate := func(ctx context.Context, args ...string) (string, error) {
		rctx, stop := context.WithCancel(ctx)
		defer stop()
		go tg.WaitGone(rctx)
		return runGPUCmd(ctx, append([]string{"migrate", "--pid", pid, "--token-file", tok, "--criu", criu, "--work-dir", e2e.ShortTempDir(t), "--json"}, args...)...)
	}
	phaseNames := func(ps []phase) map[string]bool {
		names := map[string]bool{}
		for _, p := range ps {
			names[p.Name] = true
		}
		return names
	}

	t.Run("moved", func(t *testing.T) {
		f := withFakeCUDA(t, tg.PID())
		var rout bytes.Buffer
		addr, received := startReceiver(ctx, t, &rout, "--restore", "--criu", criu, "--token-file", tok, "--json")
		out, err := migrate(ctx, "--to", "tcp://"+addr, "--streams", "2")
		if err != nil {
			t.Fatalf("migrate: %v; receiver: %v", err, <-received)
		}
		if err := <-received; err != nil {
			t.Fatalf("receive: %v", err)
		}
		if got, want := f.Log(), strings.ReplaceAll("lock P, checkpoint P, restore P, unlock P", "P", pid); got != want {
			t.Fatalf("driver calls %q, want %q", got, want)
		}
		var res migrateResult
		if err := json.Unmarshal([]byte(out), &res); err != nil {
			t.Fatal(err)
		}
		if res.RestoredPID != tg.PID() || len(res.CUDAPIDs) != 1 || len(res.GPUs) != 1 || res.GPUs[0].PID != tg.PID() {
			t.Errorf("migrate result names no CUDA process or restored pid: %s", out)
		}
		names := phaseNames(res.Phases)
		for _, n := range []string{"gpu lock", "gpu checkpoint", "criu dump + transfer", "receiver verifies (commit)", "restore on the receiver"} {
			if !names[n] {
				t.Errorf("no %q phase in %s", n, out)
			}
		}
		var rres receiveResult
		if err := json.Unmarshal(rout.Bytes(), &rres); err != nil {
			t.Fatal(err)
		}
		names = phaseNames(rres.Phases)
		for _, n := range []string{"criu restore", "gpu restore", "gpu unlock"} {
			if !names[n] {
				t.Errorf("no %q phase in %s", n, rout.String())
			}
		}
		if rres.PID != tg.PID() || len(rres.CUDAPIDs) != 1 {
			t.Errorf("receive result: %s", rout.String())
		}
		tg.ProveIntact(ctx, t, &before)
	})

	t.Run("gpu-restore-fails", func(t *testing.T) {
		f := withFakeCUDA(t, tg.PID())
		f.FailOn["restore"] = true
		keep := t.TempDir()
		addr, received := startReceiver(ctx, t, io.Discard, "--restore", "--criu", criu, "--token-file", tok)
		_, err := migrate(ctx, "--to", "tcp://"+addr, "--keep-dir", keep)
		if err == nil || !strings.Contains(err.Error(), "restore on the receiver failed") || !strings.Contains(err.Error(), "GPU state is not") {
			t.Fatalf("migrate to a failing GPU restore: %v", err)
		}
		if !strings.Contains(err.Error(), "image is kept at "+keep) {
			t.Errorf("migrate does not name the kept image: %v", err)
		}
		if rerr := <-received; rerr == nil || !strings.Contains(rerr.Error(), "GPU state is not") {
			t.Errorf("receiver: %v", rerr)
		}
		if ents, _ := os.ReadDir(keep); len(ents) != 1 {
			t.Errorf("keep dir holds %d files, want the image", len(ents))
		}
		// CRIU restored it: it runs (the fake GPU state stays checkpointed).
		tg.ProveIntact(ctx, t, &before)
	})
}

// TestReceiveSummaryOnStderr: receive without --restore, serving a client
// that restores as CRIU does, writes its summary on stderr, as it does with
// --restore; stdout (the PID's, with --restore) stays empty.
func TestReceiveSummaryOnStderr(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	dir := t.TempDir()
	tok := writeToken(t, dir)
	short := func() string {
		d, err := os.MkdirTemp("", "gcs-r-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(d) })
		return d
	}
	imgs, a := short(), short()
	var stdout, stderr pipelinetest.SyncBuffer
	received := make(chan error, 1)
	go func() {
		received <- run(ctx, []string{"receive", "--listen", "127.0.0.1:0", "--token-file", tok, "--images-dir", imgs, "--net-timeout", "3s"},
			strings.NewReader(""), &stdout, &stderr)
	}()
	var addr string
	for addr == "" {
		if _, rest, ok := strings.Cut(stderr.String(), "receive: listening on "); ok {
			addr, _, _ = strings.Cut(rest, "\n")
		}
		time.Sleep(10 * time.Millisecond)
	}
	captured := make(chan error, 1)
	go func() {
		captured <- run(ctx, []string{"capture", "--images-dir", a, "--to", "tcp://" + addr, "--token-file", tok}, strings.NewReader(""), io.Discard, io.Discard)
	}()
	dial := func(p string) net.Conn {
		for {
			c, err := net.Dial("unix", p)
			if err == nil {
				return c
			}
			if ctx.Err() != nil {
				t.Fatal(err)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	dial(filepath.Join(a, criusock.CaptureSocket)).Close() // listening
	c, err := criusock.Dial(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"core-1.img", "inventory.img"} {
		if err := c.Push(ctx, n, strings.NewReader("image "+n)); err != nil {
			t.Fatal(err)
		}
	}
	c.Close()
	if err := <-captured; err != nil {
		t.Fatalf("capture: %v", err)
	}
	// CRIU's restore: inventory.img, then the socket closes.
	criu := dial(filepath.Join(imgs, criusock.ServeSocket)).(*net.UnixConn)
	req, _ := criusock.EncodeRequest("inventory.img")
	if _, err := criu.Write(req); err != nil {
		t.Fatal(err)
	}
	if ok, err := criusock.ReadReply(criu); !ok || err != nil {
		t.Fatalf("inventory.img: %v %v", ok, err)
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	err = criusock.SendPipe(criu, pw)
	pw.Close()
	if err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(pr); err != nil || string(b) != "image inventory.img" {
		t.Fatalf("inventory.img: %q %v", b, err)
	}
	pr.Close()
	criu.Close()
	if err := <-received; err != nil {
		t.Fatalf("receive: %v\n%s", err, stderr.String())
	}
	if stdout.String() != "" {
		t.Errorf("receive without --restore wrote on stdout: %q", stdout.String())
	}
	if !strings.Contains(stderr.String(), "received 2 files") {
		t.Errorf("no summary on stderr:\n%s", stderr.String())
	}
}
