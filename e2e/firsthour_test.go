package e2e

// What a new user met in the first hour, with real CRIU.

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestCheckpointThenRestoreAtOnce: checkpoint returns only once the dumped
// tree is gone, so a restore right after it (no wait of the caller's own)
// gets its PIDs.
func TestCheckpointThenRestoreAtOnce(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 64)
	archive := filepath.Join(dir, "ck")
	// The target is this test's child: reap it when it dies, as a shell
	// reaps its jobs, while checkpoint runs.
	reaped := make(chan error, 1)
	go func() { reaped <- tg.WaitGone(ctx) }()
	start := time.Now()
	ck := gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", archive).ok(t, "checkpoint")
	// --cuda auto on a CPU-only process: nothing to say.
	if strings.Contains(ck.stderr, "--cuda") || strings.Contains(ck.stderr, "CUDA") {
		t.Errorf("checkpoint of a CPU-only process talks of CUDA:\n%s", ck.stderr)
	}
	if took := time.Since(start); took > 8*time.Second {
		t.Errorf("checkpoint took %v: it waited for a reaped process", took)
	}
	phasesAddUp(t, ck.stdout)
	r := gcsRun(ctx, t, "restore", "--from", archive).ok(t, "restore right after checkpoint")
	phasesAddUp(t, r.stderr)
	if err := <-reaped; err != nil {
		t.Fatal(err)
	}
	if pid, err := strconv.Atoi(strings.TrimSpace(r.stdout)); err != nil || pid != tg.PID() {
		t.Fatalf("restore printed %q, want the PID %d", r.stdout, tg.PID())
	}
	provenRestore(ctx, t, tg, before)
	tg.Kill()

	// ls and inspect name the process that was checkpointed.
	insp := gcsRun(ctx, t, "inspect", archive).ok(t, "inspect")
	if !strings.Contains(insp.stdout, fmt.Sprintf("process     %d: ", tg.PID())) {
		t.Errorf("inspect does not name process %d:\n%s", tg.PID(), insp.stdout)
	}
}

// TestFailedCheckpointKeepsLog: a process with a controlling terminal is
// refused by CRIU without --shell-job; the process runs on, the error says
// to pass --criu-opts --shell-job and where CRIU's log is, and the log is
// there.
func TestFailedCheckpointKeepsLog(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	tty := openTTY(t)
	cmd := exec.Command("sleep", "300")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	dir := ShortTempDir(t)
	r := gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(cmd.Process.Pid), "--to", filepath.Join(dir, "ck"))
	if r.code == 0 {
		t.Fatal("checkpoint of a process on a terminal succeeded without --shell-job")
	}
	if !strings.Contains(r.stderr, "--criu-opts --shell-job") {
		t.Errorf("no --criu-opts --shell-job hint:\n%s", r.stderr)
	}
	m := regexp.MustCompile(`criu's log is kept in (\S+);`).FindStringSubmatch(r.stderr)
	if m == nil {
		t.Fatalf("the error does not say where CRIU's log is:\n%s", r.stderr)
	}
	t.Cleanup(func() { os.RemoveAll(m[1]) })
	if _, err := os.Stat(filepath.Join(m[1], "img", "dump.log")); err != nil {
		t.Errorf("CRIU's log is not where the error says: %v", err)
	}
	time.Sleep(100 * time.Millisecond)
	if err := syscall.Kill(cmd.Process.Pid, 0); err != nil {
		t.Errorf("the process did not survive the failed checkpoint: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "ck")); err == nil {
		t.Error("the failed checkpoint left its destination directory, which it made")
	}
}

// openTTY returns the terminal side of a new pseudo-terminal.
func openTTY(t *testing.T) *os.File {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
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

// TestNoLeftovers: commands leave nothing in $TMPDIR, whatever ends them
// short of CRIU's own failure (whose log is kept, and named): a restore
// from a file that is no checkpoint is refused from its first bytes before
// CRIU starts; a checkpoint into a directory of the user's own files is
// refused before the process is touched; a checkpoint whose stdout reader
// goes away fails (the process runs on) instead of dying of SIGPIPE; and
// a checkpoint and restore that succeed.
func TestNoLeftovers(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tmp := ownTMPDIR(t, dir)
	leftNothing := func(what string) {
		t.Helper()
		ents, _ := os.ReadDir(tmp)
		for _, e := range ents {
			t.Errorf("%s left %s in $TMPDIR", what, e.Name())
			os.RemoveAll(filepath.Join(tmp, e.Name()))
		}
	}
	tg, before := startedTarget(ctx, t, dir, 32)
	pid := strconv.Itoa(tg.PID())

	notes := filepath.Join(dir, "notes.txt")
	if err := os.WriteFile(notes, []byte("shopping list\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r := gcsRun(ctx, t, "restore", "--from", notes)
	if r.code != 3 || !strings.Contains(r.stderr, notes) || strings.Contains(r.stderr, "criu") {
		t.Errorf("restore from a text file: exit %d, %s; want exit 3 naming the file, before CRIU", r.code, r.stderr)
	}
	leftNothing("restore from a text file")

	own := filepath.Join(dir, "own")
	if err := os.MkdirAll(own, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(own, "thesis.tex"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	r = gcsRun(ctx, t, "checkpoint", "--pid", pid, "--to", own)
	if r.code != 2 || !strings.Contains(r.stderr, "thesis.tex") {
		t.Errorf("checkpoint into a directory of other files: exit %d, %s; want exit 2 naming them", r.code, r.stderr)
	}
	if ents, _ := os.ReadDir(own); len(ents) != 1 {
		t.Errorf("checkpoint into a directory of other files wrote into it: %v", ents)
	}
	leftNothing("checkpoint into a directory of other files")

	// checkpoint --to - | head -c 1
	cmd := exec.CommandContext(ctx, BuildBinary(t, "./cmd/gpucr-stream"), "checkpoint", "--pid", pid, "--to", "-")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if _, err := out.Read(make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	out.Close()
	err = cmd.Wait()
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		t.Errorf("checkpoint whose reader went away died of %v:\n%s", ws.Signal(), stderr.String())
	} else if err == nil {
		t.Errorf("checkpoint whose reader went away succeeded")
	}
	t.Logf("checkpoint whose reader went away: %v: %s", err, stderr.String())
	leftNothing("checkpoint whose reader went away")
	tg.ProveIntact(ctx, t, &before)

	archive := filepath.Join(dir, "ck")
	reaped := make(chan error, 1)
	go func() { reaped <- tg.WaitGone(ctx) }()
	gcsRun(ctx, t, "checkpoint", "--pid", pid, "--to", archive).ok(t, "checkpoint")
	if err := <-reaped; err != nil {
		t.Fatal(err)
	}
	gcsRun(ctx, t, "restore", "--from", archive).ok(t, "restore")
	provenRestore(ctx, t, tg, before)
	tg.Kill()
	leftNothing("checkpoint and restore")
}

// phasesAddUp checks that the phases of a printed timing breakdown ("X
// done in 2.36s" over lines "  NAME  0.123s") add up to its total.
func phasesAddUp(t *testing.T, out string) {
	t.Helper()
	m := regexp.MustCompile(`done in ([0-9.]+)s`).FindStringSubmatch(out)
	if m == nil {
		t.Errorf("no timing breakdown in\n%s", out)
		return
	}
	total, _ := strconv.ParseFloat(m[1], 64)
	sum := 0.0
	for _, p := range regexp.MustCompile(`(?m)^  \S.*\s([0-9.]+)s$`).FindAllStringSubmatch(out, -1) {
		v, _ := strconv.ParseFloat(p[1], 64)
		sum += v
	}
	if d := total - sum; d > max(0.05, total/20) || d < -0.02 {
		t.Errorf("phases sum to %.3fs, the total is %.2fs:\n%s", sum, total, out)
	}
}

// TestMakeInstall: the README's `make install` installs the binary and the
// fast path's library where that binary looks for it (`gpucr-stream run`
// once failed right after the install step), for the default PREFIX (under
// DESTDIR) and for another PREFIX: the binary finds PREFIX/lib/gpucr-stream
// from its own PREFIX/bin.
func TestMakeInstall(t *testing.T) {
	if _, err := exec.LookPath("cc"); err != nil {
		missing(t, "a C compiler (cc) for libgpucr-preload.so")
	}
	root := ModuleRoot(t)
	for _, tc := range []struct{ name, arg, prefix string }{
		{"default prefix", "DESTDIR=", "usr/local"},
		{"own prefix", "PREFIX=", "opt/gcs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dest := t.TempDir()
			arg, prefix := tc.arg+dest, filepath.Join(dest, tc.prefix)
			if tc.arg == "PREFIX=" {
				arg = tc.arg + prefix
			}
			cmd := exec.Command("make", "--no-print-directory", "install", arg)
			cmd.Dir = root
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("make install %s: %v\n%s", arg, err, out)
			}
			bin := filepath.Join(prefix, "bin/gpucr-stream")
			lib := filepath.Join(prefix, "lib/gpucr-stream/libgpucr-preload.so")
			for _, p := range []string{bin, lib} {
				if _, err := os.Stat(p); err != nil {
					t.Fatalf("make install %s did not install %s:\n%s", arg, p, out)
				}
			}
			msg, err := exec.Command(bin, "run", "--", "true").CombinedOutput()
			if err != nil {
				t.Fatalf("the installed gpucr-stream run does not find the installed library: %v\n%s", err, msg)
			}
		})
	}
}

// TestS3FirstDay: S3 as a new user meets it, with real MinIO on loopback.
// An endpoint whose host does not resolve fails at once, naming
// --s3-endpoint, instead of being retried for 11 s; a server-side
// encryption the server cannot do (this MinIO has no KMS) is refused
// before CRIU freezes the process, not at the first segment; and a
// loopback endpoint draws no plain-http warning (nothing crosses a
// network).
func TestS3FirstDay(t *testing.T) {
	e := startS3(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tmp := ownTMPDIR(t, dir) // the build is not timed below

	start := time.Now()
	r := gcsRun(ctx, t, "ls", e.url(""), "--s3-endpoint", "http://no-such-host.invalid:9000")
	if took := time.Since(start); r.code != 1 || !strings.Contains(r.stderr, "--s3-endpoint") || took > 3*time.Second {
		t.Errorf("ls at an unknown host: exit %d after %v: %s; want exit 1 at once naming --s3-endpoint", r.code, took, r.stderr)
	}

	tg, before := startedTarget(ctx, t, dir, 16)
	r = gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", e.url("sse"), "--s3-sse", "s3")
	if r.code != 1 || !strings.Contains(r.stderr, "--s3-sse") {
		t.Errorf("checkpoint with an SSE the server cannot do: exit %d: %s; want exit 1 naming --s3-sse", r.code, r.stderr)
	}
	if ents, _ := os.ReadDir(tmp); len(ents) > 0 {
		t.Errorf("CRIU ran (%s is in $TMPDIR) before the SSE was refused: %s", ents[0].Name(), r.stderr)
	}
	if keys := e.keys(ctx, t, "sse/"); len(keys) > 0 {
		t.Errorf("the refused checkpoint left %v", keys)
	}
	tg.ProveIntact(ctx, t, &before)

	r = gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", e.url("ok"), "--leave-running").ok(t, "checkpoint")
	if strings.Contains(r.stderr, "plain http") {
		t.Errorf("a loopback endpoint drew the plain-http warning:\n%s", r.stderr)
	}
}

// TestDemo: `make demo`'s script says what each number is (no bare
// real/user/sys blocks, no bare statistics JSON), says what becomes of the
// restored process, and takes its files (the archive: 202 MB at the
// default size) away with it.
func TestDemo(t *testing.T) {
	criu := CRIU(t)
	ctx := testCtx(t)
	cmd := exec.CommandContext(ctx, "bash", filepath.Join(ModuleRoot(t), "scripts", "demo.sh"))
	cmd.Env = append(os.Environ(), "DEMO_MB=32", "CRIU="+criu, "GCS="+BuildBinary(t, "./cmd/gpucr-stream"))
	var buf bytes.Buffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// The demo waits for its dumped target to be reaped. Where this test
	// process is the subreaper (StartTarget made it one), that orphan is
	// ours to reap, as init would.
	done := make(chan struct{})
	reaped := make(chan struct{})
	go func() {
		defer close(reaped)
		for {
			reapZombieOrphans(cmd.Process.Pid)
			select {
			case <-done:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	err := cmd.Wait()
	close(done)
	<-reaped
	out := buf.Bytes()
	if err != nil {
		t.Fatalf("demo: %v\n%s", err, out)
	}
	s := string(out)
	for _, want := range []string{"criu dump --stream took ", "criu restore --stream took ", "gpucr-stream capture: ",
		" files, ", "memory checksum OK", "are killed now that the demo ends", "are removed too"} {
		if !strings.Contains(s, want) {
			t.Errorf("the demo does not say %q:\n%s", want, s)
		}
	}
	for _, bad := range []string{"\nreal\t", `{"shards"`, "MISMATCH"} {
		if strings.Contains(s, bad) {
			t.Errorf("the demo prints %q:\n%s", bad, s)
		}
	}
	m := regexp.MustCompile(`--to (/tmp/gcs-demo-\w+)/archive`).FindStringSubmatch(s)
	if m == nil {
		t.Fatalf("the demo does not name its archive:\n%s", s)
	}
	if _, err := os.Stat(m[1]); err == nil {
		os.RemoveAll(m[1])
		t.Errorf("the demo left %s", m[1])
	}
}

// reapZombieOrphans reaps the zombie children of this process, but not
// except (a child whose exec.Cmd waits for it).
func reapZombieOrphans(except int) {
	ents, _ := os.ReadDir("/proc")
	me := os.Getpid()
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == except {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces and parentheses.
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		if len(f) > 1 && f[0] == "Z" && f[1] == strconv.Itoa(me) {
			var ws unix.WaitStatus
			unix.Wait4(pid, &ws, unix.WNOHANG, nil)
		}
	}
}

// ownTMPDIR gives the commands this test runs a $TMPDIR of their own in
// dir, to see what they leave there; gpucr-stream is built first (its
// build dir is in the old $TMPDIR).
func ownTMPDIR(t *testing.T, dir string) string {
	t.Helper()
	tmp := filepath.Join(dir, "tmp")
	if err := os.Mkdir(tmp, 0o700); err != nil {
		t.Fatal(err)
	}
	BuildBinary(t, "./cmd/gpucr-stream")
	t.Setenv("TMPDIR", tmp)
	return tmp
}
