package e2e

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/testwait"
)

// proc is a running gpucr-stream (or shell pipeline) with its progress
// lines (fd 3 for gpucr-stream) and stderr captured.
type proc struct {
	t        testing.TB
	name     string
	cmd      *exec.Cmd
	stderr   bytes.Buffer
	progress chan string
	done     chan struct{}
	err      error
}

// gcsOpts plumbs a gpucr-stream process.
type gcsOpts struct {
	stdin  io.Reader
	stdout io.Writer
	// stderr, when set, gets a copy of the process's stderr.
	stderr io.Writer
	// bin, when set, is the gpucr-stream binary run (another build).
	bin string
	// extra become fds 4, 5, ... (fd 3 is the progress pipe).
	extra []*os.File
}

func startGCS(ctx context.Context, t testing.TB, o gcsOpts, args ...string) *proc {
	t.Helper()
	bin := o.bin
	if bin == "" {
		bin = BuildBinary(t, "./cmd/gpucr-stream")
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, bin, append([]string{"--progress-fd", "3"}, args...)...)
	cmd.Stdin, cmd.Stdout = o.stdin, o.stdout
	cmd.ExtraFiles = append([]*os.File{pw}, o.extra...)
	p := &proc{t: t, name: "gpucr-stream " + strings.Join(args, " "), cmd: cmd, progress: make(chan string, 16), done: make(chan struct{})}
	cmd.Stderr = &p.stderr
	if o.stderr != nil {
		cmd.Stderr = io.MultiWriter(&p.stderr, o.stderr)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pw.Close()
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			p.progress <- sc.Text()
		}
		pr.Close()
		close(p.progress)
	}()
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		if cmd.Process != nil {
			cmd.Process.Kill()
		}
		<-p.done
	})
	return p
}

// waitLine waits for a progress line; false if the process ended first.
func (p *proc) waitLine(ctx context.Context, want string) bool {
	p.t.Helper()
	for {
		select {
		case l, ok := <-p.progress:
			if !ok {
				return false
			}
			if l == want {
				return true
			}
		case <-ctx.Done():
			p.t.Fatalf("%s: no %q line: %v", p.name, want, ctx.Err())
		}
	}
}

// wait returns the exit error with stderr attached.
func (p *proc) wait(ctx context.Context) error {
	select {
	case <-p.done:
	case <-ctx.Done():
		p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("%s: %w; stderr: %s", p.name, ctx.Err(), p.stderr.String())
	}
	if p.err != nil {
		return fmt.Errorf("%s: %w; stderr: %s", p.name, p.err, p.stderr.String())
	}
	return nil
}

// exitCode waits and returns the exit code.
func (p *proc) exitCode(ctx context.Context) int {
	_ = p.wait(ctx)
	return p.cmd.ProcessState.ExitCode()
}

// lastJSON is the statistics line, the last progress line.
func (p *proc) lines() []string {
	var out []string
	for l := range p.progress {
		out = append(out, l)
	}
	return out
}

func mkdir(t testing.TB, p string) string {
	t.Helper()
	if err := os.MkdirAll(p, 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// dumpThrough runs `criu dump --stream` against a capture that is already
// listening and waits for both.
func dumpThrough(ctx context.Context, t testing.TB, tg *Target, images string, capture *proc) {
	t.Helper()
	if !capture.waitLine(ctx, "socket-init") {
		t.Fatalf("capture ended before listening: %v", capture.wait(ctx))
	}
	if err := RunCRIU(ctx, t, "dump", "--stream", "-D", images, "-t", strconv.Itoa(tg.PID()), "-o", "dump.log", "-v4"); err != nil {
		t.Fatalf("criu dump --stream: %v (capture: %v)", err, capture.wait(ctx))
	}
	if err := capture.wait(ctx); err != nil {
		t.Fatalf("capture: %v", err)
	}
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatalf("after dump: %v", err)
	}
}

// restoreThrough runs `criu restore --stream` against a serve process and
// returns CRIU's error and serve's.
func restoreThrough(ctx context.Context, t testing.TB, images string, serve *proc) (criuErr, serveErr error) {
	t.Helper()
	if !serve.waitLine(ctx, "socket-init") {
		return errors.New("serve ended before listening"), serve.wait(ctx)
	}
	criuErr = RunCRIU(ctx, t, "restore", "--stream", "-D", images, "--restore-detached", "-o", "restore.log", "-v4")
	return criuErr, serve.wait(ctx)
}

// restoreStream restores the stream file stream through `serve` (with
// args) into `criu restore --stream` in dir/b, failing the test on either's
// error.
func restoreStream(ctx context.Context, t testing.TB, dir, stream string, args ...string) {
	t.Helper()
	in, err := os.Open(stream)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	b := mkdir(t, filepath.Join(dir, "b"))
	serve := startGCS(ctx, t, gcsOpts{stdin: in}, append([]string{"--images-dir", b, "serve"}, args...)...)
	if criuErr, serveErr := restoreThrough(ctx, t, b, serve); criuErr != nil || serveErr != nil {
		t.Fatalf("restore: criu: %v; serve: %v", criuErr, serveErr)
	}
}

// provenRestore checks the restored target against the proof taken before
// the dump, twice, so it is seen running on.
func provenRestore(ctx context.Context, t testing.TB, tg *Target, before Proof) {
	t.Helper()
	after, err := tg.Prove(ctx)
	if err != nil {
		t.Fatalf("proof after restore: %v", err)
	}
	if err := after.Check(before); err != nil {
		t.Fatalf("restored target: %v", err)
	}
	if _, err := tg.ProveAdvanced(ctx, after); err != nil {
		t.Fatalf("restored target, second proof: %v", err)
	}
}

func startedTarget(ctx context.Context, t testing.TB, dir string, mb int, extra ...string) (*Target, Proof) {
	t.Helper()
	tg := StartTarget(t, filepath.Join(dir, "target"), mb, extra...)
	before, err := tg.Prove(ctx)
	if err != nil {
		t.Fatalf("proof before dump: %v", err)
	}
	if err := before.Verify(); err != nil {
		t.Fatalf("proof before dump: %v", err)
	}
	return tg, before
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// waitForFile waits until a path exists (a socket a pipeline is listening on).
func waitForFile(ctx context.Context, t testing.TB, p string) {
	t.Helper()
	for {
		if _, err := os.Stat(p); err == nil {
			// A socket file appears at bind, a moment before listen.
			time.Sleep(50 * time.Millisecond)
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v", p, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// receiver is a `receive --listen 127.0.0.1:0` on a loopback port, with
// the address it said it listens on.
type receiver struct {
	addr   string
	stdout strings.Builder
	stderr pipelinetest.SyncBuffer // its lines so far, also while it runs
	done   chan struct{}           // closed once it ended, err set
	err    error                   // how it ended, with its stderr
}

// startReceiver starts cmd, a prepared `receive --listen 127.0.0.1:0`, with
// its stdout into r.stdout, and waits up to listenWait (scaled to the
// machine's load) for the address it listens on.
func startReceiver(t *testing.T, cmd *exec.Cmd, listenWait time.Duration) *receiver {
	t.Helper()
	r := &receiver{done: make(chan struct{})}
	cmd.Stdout = &r.stdout
	pr, pw := io.Pipe()
	cmd.Stderr = pw
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	listening := make(chan string, 1)
	scanned := make(chan struct{})
	go func() {
		defer close(scanned)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			if _, addr, ok := strings.Cut(sc.Text(), "receive: listening on "); ok {
				select {
				case listening <- addr:
				default:
				}
			}
			fmt.Fprintln(&r.stderr, sc.Text())
		}
	}()
	go func() {
		err := cmd.Wait()
		pw.Close()
		<-scanned // every stderr line is in r.stderr
		if err != nil {
			err = fmt.Errorf("receive: %v: %s", err, r.stderr.String())
		}
		r.err = err
		close(r.done)
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-r.done
	})
	select {
	case r.addr = <-listening:
	case <-r.done:
		t.Fatalf("receive ended before listening: %v", r.err)
	case <-time.After(testwait.Scale(listenWait)):
		t.Fatal("receive does not listen")
	}
	return r
}

// wait returns how the receiver ended, or ctx's error.
func (r *receiver) wait(ctx context.Context) error {
	select {
	case <-r.done:
		return r.err
	case <-ctx.Done():
		return ctx.Err()
	}
}
