package e2e

// Interruptions: Ctrl-C in the middle of a checkpoint must leave the
// process as it was, running, with nothing of CRIU left in it.

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/testwait"
)

// TestCheckpointInterrupted interrupts `gpucr-stream checkpoint` of one
// target at three points (CRIU started but not yet dumping; pages
// streaming, CRIU's parasite in the process; CRIU's post-dump action
// waiting for the commit), with SIGINT to the command's process group, as
// a terminal's Ctrl-C is sent, and to gpucr-stream alone. Each time the
// command exits 130 saying it was interrupted and that the process runs
// on; the process proves itself intact, no tracer holds it, it maps no
// file it did not map before (no /memfd:CRIUMFD of CRIU's parasite), and
// no checkpoint was committed.
func TestCheckpointInterrupted(t *testing.T) {
	criu := CRIU(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	dir := ShortTempDir(t)
	tg, last := startedTarget(ctx, t, dir, 512)
	mapped := mappedNames(t, tg.PID(), tg.ChildPID())
	for _, point := range []string{"before the dump", "pages streaming", "post-dump"} {
		for _, group := range []bool{true, false} {
			name := point + map[bool]string{true: ", group", false: ", alone"}[group]
			t.Run(name, func(t *testing.T) {
				to := filepath.Join(dir, "ck-"+strings.NewReplacer(" ", "-", ",", "").Replace(name))
				marker := filepath.Join(dir, "post-dump-reached")
				os.Remove(marker)
				cmd := exec.Command(HooksBinary(t), "checkpoint", "--pid", strconv.Itoa(tg.PID()),
					"--to", to, "--criu", criu, "--no-progress")
				cmd.Env = append(os.Environ(), "GPUCR_TEST_PAUSE=post-dump:"+marker)
				var stdout, stderr bytes.Buffer
				cmd.Stdout, cmd.Stderr = &stdout, &stderr
				// Its own process group, as a shell starts a job.
				cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
				if err := cmd.Start(); err != nil {
					t.Fatal(err)
				}
				waited := make(chan error, 1)
				go func() { waited <- cmd.Wait() }()
				gcs := cmd.Process.Pid
				reached(ctx, t, waited, stderr.String, func() bool {
					switch point {
					case "before the dump":
						return criuDumping(gcs)
					case "pages streaming":
						return slices.Contains(namesMapped(tg.PID()), "/memfd:CRIUMFD") && treeBytes(to) > 1<<20
					}
					return fileExists(marker)
				})
				target := gcs
				if group {
					target = -gcs
				}
				if err := syscall.Kill(target, syscall.SIGINT); err != nil {
					t.Fatal(err)
				}
				select {
				case <-waited:
				case <-ctx.Done():
					cmd.Process.Kill()
					t.Fatalf("checkpoint did not end after SIGINT\nstderr: %s", stderr.String())
				}
				t.Logf("stderr:\n%s", stderr.String())
				if code := cmd.ProcessState.ExitCode(); code != 130 {
					t.Errorf("exit %d after SIGINT, want 130", code)
				}
				says := fmt.Sprintf("process %d runs on, with no CRIU mapping left in it", tg.PID())
				if !strings.Contains(stderr.String(), "interrupted by SIGINT") || !strings.Contains(stderr.String(), says) {
					t.Errorf("the error does not say it was interrupted and %q:\n%s", says, stderr.String())
				}
				for _, noise := range []string{"context canceled", "use of closed", "signal: killed", "signal: interrupt"} {
					if strings.Contains(stderr.String(), noise) {
						t.Errorf("the error says %q:\n%s", noise, stderr.String())
					}
				}
				for _, pid := range []int{tg.PID(), tg.ChildPID()} {
					if tracer := tracerOf(pid); tracer != 0 {
						t.Errorf("process %d is still traced by %d", pid, tracer)
					}
				}
				if now := mappedNames(t, tg.PID(), tg.ChildPID()); !subset(now, mapped) {
					t.Errorf("after the interrupt the target maps %q; before it mapped %q", now, mapped)
				}
				if fileExists(filepath.Join(to, "manifest.json")) {
					t.Error("an interrupted checkpoint committed a manifest")
				} else if fileExists(to) {
					t.Errorf("the interrupted checkpoint left %s, which it made", to)
				}
				tg.ProveIntact(ctx, t, &last)
			})
		}
	}
}

// reached waits until cond holds, polling; the command ending first, or
// ctx, fails the test.
func reached(ctx context.Context, t *testing.T, waited chan error, stderr func() string, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case err := <-waited:
			waited <- err
			t.Fatalf("the command ended (%v) before the point it was to be interrupted at\nstderr: %s", err, stderr())
		case <-ctx.Done():
			t.Fatalf("the point was never reached: %v", ctx.Err())
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// criuDumping says a child of pid runs `criu dump`.
func criuDumping(pid int) bool { return criuRunning(pid, "dump") }

// criuRunning says a child of pid runs `criu VERB`.
func criuRunning(pid int, verb string) bool {
	files, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	for _, f := range files {
		b, _ := os.ReadFile(f)
		for _, c := range strings.Fields(string(b)) {
			if cl, err := os.ReadFile("/proc/" + c + "/cmdline"); err == nil && bytes.Contains(cl, []byte("\x00"+verb+"\x00")) {
				return true
			}
		}
	}
	return false
}

// namesMapped lists the files pid maps, as /proc/PID/maps names them
// (without " (deleted)").
func namesMapped(pid int) []string {
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if i := strings.IndexByte(sc.Text(), '/'); i >= 0 {
			n := strings.TrimSuffix(sc.Text()[i:], " (deleted)")
			if !slices.Contains(out, n) {
				out = append(out, n)
			}
		}
	}
	return out
}

// mappedNames is namesMapped of each of pids, each name prefixed with its
// process's place in pids.
func mappedNames(t *testing.T, pids ...int) []string {
	t.Helper()
	var out []string
	for i, p := range pids {
		names := namesMapped(p)
		if len(names) == 0 {
			t.Fatalf("process %d maps nothing (gone?)", p)
		}
		for _, n := range names {
			out = append(out, fmt.Sprintf("%d:%s", i, n))
		}
	}
	return out
}

func subset(a, b []string) bool {
	for _, x := range a {
		if !slices.Contains(b, x) {
			return false
		}
	}
	return true
}

// tracerOf is TracerPid of /proc/PID/status.
func tracerOf(pid int) int {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "TracerPid:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}

// treeBytes is the size of the files under dir (temporary ones included).
func treeBytes(dir string) int64 {
	var n int64
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			if info, err := d.Info(); err == nil {
				n += info.Size()
			}
		}
		return nil
	})
	return n
}

// TestInterruptSaysInterrupted interrupts (SIGINT) receive --restore during
// a migration into it, restore from an archive and from a stream on stdin
// while CRIU restores, serve while CRIU reads from it, and cp while it
// copies. Each exits 130 saying it was interrupted, in words, and not what
// the interrupt broke on its way (a CRIU that failed, a pipe closed under a
// splice, a canceled context); a restore says that nothing was restored,
// and nothing was; migrate, that the process keeps running here.
// (checkpoint: TestCheckpointInterrupted.)
func TestInterruptSaysInterrupted(t *testing.T) {
	criu := CRIU(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	dir := ShortTempDir(t)
	tg, _ := startedTarget(ctx, t, dir, 512)
	pid := strconv.Itoa(tg.PID())
	bin := BuildBinary(t, "./cmd/gpucr-stream")
	token := writeToken(t, bin, filepath.Join(dir, "token"))
	t.Run("receive", func(t *testing.T) {
		r, addr := startReceiveRestore(t, token, criu)
		mig := startGcs(t, nil, "migrate", "--pid", pid, "--to", "tcp://"+addr, "--token-file", token, "--criu", criu, "--no-progress")
		r.reached(ctx, t, func() bool { return strings.Contains(r.stderr.String(), "authenticated") })
		r.saysInterrupted(ctx, t, "receive: ")
		mig.wait(ctx, t)
		if !fileExists(fmt.Sprintf("/proc/%d", tg.PID())) {
			t.Fatalf("the migrated process is gone after its receiver was interrupted\nmigrate: %s", mig.stderr.String())
		}
	})
	t.Run("migrate", func(t *testing.T) {
		r, addr := startReceiveRestore(t, token, criu)
		mig := startGcs(t, nil, "migrate", "--pid", pid, "--to", "tcp://"+addr, "--token-file", token, "--criu", criu, "--no-progress")
		mig.reached(ctx, t, func() bool { return criuDumping(mig.cmd.Process.Pid) })
		mig.saysInterrupted(ctx, t, "keeps running here")
		r.wait(ctx, t)
	})
	stream := filepath.Join(dir, "ck.stream")
	f, err := os.Create(stream)
	if err != nil {
		t.Fatal(err)
	}
	ck := exec.CommandContext(ctx, bin, "checkpoint", "--pid", pid, "--leave-running", "--criu", criu, "--no-progress")
	var ckErr bytes.Buffer
	ck.Stdout, ck.Stderr = f, &ckErr
	if err := ck.Run(); err != nil {
		t.Fatalf("checkpoint to a stream: %v\n%s", err, ckErr.String())
	}
	f.Close()
	archive := filepath.Join(dir, "ck")
	gcsRun(ctx, t, "checkpoint", "--pid", pid, "--to", archive, "--criu", criu, "--no-progress").ok(t, "checkpoint")
	targetGone(ctx, t, tg)

	for _, from := range []string{"archive", "stream"} {
		t.Run("restore from "+from, func(t *testing.T) {
			var in io.Reader
			src := archive
			if from == "stream" {
				b, err := os.ReadFile(stream)
				if err != nil {
					t.Fatal(err)
				}
				in, src = bytes.NewReader(b), "-"
			}
			g := startGcs(t, in, "restore", "--from", src, "--criu", criu, "--no-progress")
			g.reached(ctx, t, func() bool { return criuRunning(g.cmd.Process.Pid, "restore") })
			g.saysInterrupted(ctx, t, "nothing was restored")
			targetGone(ctx, t, tg)
		})
	}
	t.Run("serve", func(t *testing.T) {
		images := filepath.Join(dir, "img")
		g := startGcs(t, nil, "--images-dir", images, "serve", "--from", archive)
		g.reached(ctx, t, func() bool { return strings.Contains(g.stderr.String(), "socket-init") })
		c := exec.CommandContext(ctx, criu, "restore", "--stream", "-D", images, "--restore-detached", "-o", "restore.log")
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		g.reached(ctx, t, func() bool { return treeBytes(filepath.Join(images, "restore.log")) > 0 })
		g.saysInterrupted(ctx, t, "serve: interrupted")
		c.Wait()
		targetGone(ctx, t, tg)
	})
	t.Run("cp", func(t *testing.T) {
		to := filepath.Join(dir, "copy")
		g := startGcs(t, nil, "cp", archive, to, "--no-progress")
		g.reached(ctx, t, func() bool { return treeBytes(to) > 1<<20 })
		g.saysInterrupted(ctx, t, "cp: ")
	})
}

// startReceiveRestore starts receive --restore on a free loopback port, in
// its own process group, and returns it with the address it listens on.
func startReceiveRestore(t *testing.T, token, criu string) (*gcsProc, string) {
	t.Helper()
	cmd := exec.Command(BuildBinary(t, "./cmd/gpucr-stream"), "receive", "--listen", "127.0.0.1:0", "--restore",
		"--token-file", token, "--criu", criu, "--no-progress")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	r := startReceiver(t, cmd, 20*time.Second)
	return &gcsProc{cmd: cmd, stderr: &r.stderr, done: r.done}, r.addr
}

// saysInterrupted interrupts g and checks that it exits 130 saying it was
// interrupted and more, and nothing of what the interrupt broke.
func (g *gcsProc) saysInterrupted(ctx context.Context, t *testing.T, more string) {
	t.Helper()
	g.interrupt(ctx, t)
	if code := g.cmd.ProcessState.ExitCode(); code != 130 {
		t.Errorf("exit %d after SIGINT, want 130", code)
	}
	stderr := g.stderr.String()
	if !strings.Contains(stderr, "interrupted by SIGINT") || !strings.Contains(stderr, more) {
		t.Errorf("the error does not say it was interrupted and %q:\n%s", more, stderr)
	}
	for _, noise := range []string{"context canceled", "use of closed", "signal: killed", "signal: interrupt", "exit status"} {
		if strings.Contains(stderr, noise) {
			t.Errorf("the error says %q:\n%s", noise, stderr)
		}
	}
}

// targetGone waits, up to 5 s scaled to the machine's load, for tg's
// processes to be gone (checkpointed, or what an interrupted restore must
// not have left), reaping them where this test is their subreaper.
func targetGone(ctx context.Context, t *testing.T, tg *Target) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, testwait.Scale(5*time.Second))
	defer cancel()
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatal(err)
	}
}

// gcsProc is gpucr-stream running in its own process group, as a shell
// starts a job.
type gcsProc struct {
	cmd    *exec.Cmd
	stderr *pipelinetest.SyncBuffer
	done   chan struct{} // closed once it ended
}

// startGcs starts gpucr-stream with args, stdin from in (nil: none); the
// test's end kills it.
func startGcs(t *testing.T, in io.Reader, args ...string) *gcsProc {
	t.Helper()
	g := &gcsProc{cmd: exec.Command(BuildBinary(t, "./cmd/gpucr-stream"), args...), stderr: &pipelinetest.SyncBuffer{}, done: make(chan struct{})}
	g.cmd.Stdin, g.cmd.Stderr = in, g.stderr
	g.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := g.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		g.cmd.Wait()
		close(g.done)
	}()
	t.Cleanup(func() {
		g.cmd.Process.Kill()
		<-g.done
	})
	return g
}

// reached waits until cond holds; g ending first, or ctx, fails the test.
func (g *gcsProc) reached(ctx context.Context, t *testing.T, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case <-g.done:
			t.Fatalf("%s ended (%v) before the point it was to be interrupted at\nstderr: %s", g.cmd.Args[1:], g.cmd.ProcessState, g.stderr.String())
		case <-ctx.Done():
			t.Fatalf("the point was never reached: %v", ctx.Err())
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// interrupt sends SIGINT to g's process group, as a terminal's Ctrl-C,
// and waits for g to end.
func (g *gcsProc) interrupt(ctx context.Context, t *testing.T) {
	t.Helper()
	if err := syscall.Kill(-g.cmd.Process.Pid, syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	g.wait(ctx, t)
}

// wait waits for g to end.
func (g *gcsProc) wait(ctx context.Context, t *testing.T) {
	t.Helper()
	select {
	case <-g.done:
	case <-ctx.Done():
		t.Fatalf("%s did not end\nstderr: %s", g.cmd.Args[1:], g.stderr.String())
	}
}
