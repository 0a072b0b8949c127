// Package e2e holds the end-to-end tests of gpucr-stream: they checkpoint and
// restore real processes with a real CRIU (and, where present, a real MinIO,
// network namespaces and CUDA processes), and check that what comes back
// still works. This file holds the helpers those tests share: locating CRIU,
// building binaries of this module, and driving the target program in
// e2e/target, whose proofs say whether a restored process kept its memory,
// its child and its progress.
//
// The tests need root. Without a usable component (CRIU >= 4.0, root) they
// skip, except under CI=true, where a missing component is a failure.
// scripts/install-criu.sh installs a CRIU that works on this machine kind.
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/testhook"
	"golang.org/x/sys/unix"
)

// DefaultCRIUPrefixBin is where scripts/install-criu.sh puts its wrapper.
const DefaultCRIUPrefixBin = "/opt/gpucr-criu/bin/criu"

// missing skips the test, or fails it under CI, where a component that
// silently skips would let a broken setup pass.
func missing(t testing.TB, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("CI=true and a required component is missing: "+format, args...)
	}
	t.Skipf(format, args...)
}

var criuOnce struct {
	sync.Once
	path string
	why  string // non-empty: no usable CRIU, and why
}

// CRIU returns the path of a usable criu (>= 4.0): $GPUCR_CRIU, else criu on
// PATH, else the prefix that scripts/install-criu.sh installs. It skips the
// test (fails it under CI=true) when there is none or when not running as
// root.
func CRIU(t testing.TB) string {
	t.Helper()
	if os.Geteuid() != 0 {
		missing(t, "CRIU tests need root (euid %d)", os.Geteuid())
	}
	criuOnce.Do(func() { criuOnce.path, criuOnce.why = findCRIU() })
	if criuOnce.why != "" {
		missing(t, "%s (run scripts/install-criu.sh or set GPUCR_CRIU)", criuOnce.why)
	}
	return criuOnce.path
}

func findCRIU() (path, why string) {
	if env := os.Getenv("GPUCR_CRIU"); env != "" {
		if err := criuUsable(env); err != nil {
			return "", fmt.Sprintf("GPUCR_CRIU=%s is not usable: %v", env, err)
		}
		return env, ""
	}
	candidates := []string{DefaultCRIUPrefixBin}
	if p, err := exec.LookPath("criu"); err == nil {
		candidates = []string{p, DefaultCRIUPrefixBin}
	}
	var tried []string
	for _, p := range candidates {
		err := criuUsable(p)
		if err == nil {
			return p, ""
		}
		tried = append(tried, fmt.Sprintf("%s: %v", p, err))
	}
	return "", "no usable criu >= 4.0: " + strings.Join(tried, "; ")
}

var criuVersionRE = regexp.MustCompile(`(?m)^Version:\s*(\d+)\.(\d+)`)

// criuUsable also runs `criu check`, because an old or mismatched CRIU
// (bookworm's 3.17 on a new kernel) starts but fails every dump.
func criuUsable(path string) error {
	out, err := exec.Command(path, "--version").CombinedOutput()
	if err != nil {
		return fmt.Errorf("criu --version: %w: %s", err, bytes.TrimSpace(out))
	}
	m := criuVersionRE.FindSubmatch(out)
	if m == nil {
		return fmt.Errorf("criu --version: no version in %q", bytes.TrimSpace(out))
	}
	if major, _ := strconv.Atoi(string(m[1])); major < 4 {
		return fmt.Errorf("criu %s.%s is older than 4.0", m[1], m[2])
	}
	if os.Geteuid() == 0 {
		if out, err := exec.Command(path, "check").CombinedOutput(); err != nil {
			return fmt.Errorf("criu check: %w: %s", err, tail(out, 5))
		}
	}
	return nil
}

// ModuleRoot returns the directory of this module's go.mod, found by walking
// up from the test's working directory (the package directory under go test).
func ModuleRoot(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatalf("getwd: %v", err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatalf("no go.mod above the working directory")
		}
		dir = parent
	}
}

type buildResult struct {
	once sync.Once
	path string
	err  error
}

var builds struct {
	mu     sync.Mutex
	dir    string
	byPkg  map[string]*buildResult
	dirErr error
}

// BuildBinary builds a main package of this module (e.g. "./e2e/target",
// "./cmd/gpucr-stream") with CGO_ENABLED=0, once per test process, and
// returns the binary's path. With GPUCR_PREBUILT=DIR it returns DIR/NAME
// instead, NAME being pkg with slashes as dashes (e2e-target, cmd-gpucr-stream).
func BuildBinary(t testing.TB, pkg string) string {
	t.Helper()
	return buildBinary(t, pkg, "")
}

// HooksBinary is gpucr-stream built with its test hooks (package
// testhook: GPUCR_TEST_FAULT, GPUCR_TEST_PAUSE), which the shipped binary
// lacks: the tests that inject faults or pauses run it. With
// GPUCR_PREBUILT=DIR it is DIR/cmd-gpucr-stream-testhooks (make
// build-testhooks builds bin/gpucr-stream-testhooks).
func HooksBinary(t testing.TB) string {
	t.Helper()
	return buildBinary(t, "./cmd/gpucr-stream", testhook.Tag)
}

func buildBinary(t testing.TB, pkg, tags string) string {
	t.Helper()
	root := ModuleRoot(t)
	name := strings.ReplaceAll(strings.Trim(pkg, "./"), "/", "-")
	if tags != "" {
		name += "-" + strings.TrimPrefix(tags, "gpucr_")
	}
	builds.mu.Lock()
	if builds.byPkg == nil {
		builds.byPkg = map[string]*buildResult{}
		builds.dir, builds.dirErr = binDir()
	}
	dir, dirErr := builds.dir, builds.dirErr
	r := builds.byPkg[name]
	if r == nil {
		r = &buildResult{}
		builds.byPkg[name] = r
	}
	builds.mu.Unlock()
	if dirErr != nil {
		t.Fatalf("build %s: %v", pkg, dirErr)
	}
	r.once.Do(func() {
		// A machine without a Go toolchain (the GPU machine) runs a test
		// binary built elsewhere against binaries built with it.
		if pre := os.Getenv("GPUCR_PREBUILT"); pre != "" {
			r.path = filepath.Join(pre, name)
			if !fileExists(r.path) {
				r.err = fmt.Errorf("build %s: GPUCR_PREBUILT=%s has no %s", pkg, pre, name)
			}
			return
		}
		out := filepath.Join(dir, name)
		cmd := exec.Command(goTool(), "build", "-tags", tags, "-o", out, pkg)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		start := time.Now()
		if b, err := cmd.CombinedOutput(); err != nil {
			r.err = fmt.Errorf("go build %s: %w\n%s", pkg, err, b)
			return
		}
		r.path = out
		t.Logf("built %s in %v", name, time.Since(start).Round(time.Millisecond))
	})
	if r.err != nil {
		t.Fatal(r.err)
	}
	return r.path
}

// goTool finds the go command: go test puts it first on PATH, a test binary
// run by hand may not have it there.
func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	for _, root := range []string{os.Getenv("GOROOT"), "/usr/local/go"} {
		if p := filepath.Join(root, "bin", "go"); root != "" && fileExists(p) {
			return p
		}
	}
	return "go"
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// binDir makes the directory for this process's binaries. Tests have no hook
// at process exit (and TestMain belongs to the package's tests), so the
// directory is named after the pid and leftovers of dead processes are
// removed here instead.
func binDir() (string, error) {
	base := os.TempDir()
	if old, _ := filepath.Glob(filepath.Join(base, "gpucr-e2e-bin-*")); len(old) > 0 {
		for _, d := range old {
			f := strings.SplitN(strings.TrimPrefix(filepath.Base(d), "gpucr-e2e-bin-"), "-", 2)
			if pid, err := strconv.Atoi(f[0]); err == nil && pid != os.Getpid() && !pidExists(pid) {
				os.RemoveAll(d)
			}
		}
	}
	dir, err := os.MkdirTemp(base, fmt.Sprintf("gpucr-e2e-bin-%d-", os.Getpid()))
	if err != nil {
		return "", fmt.Errorf("make binary dir: %w", err)
	}
	return dir, nil
}

// ShortTempDir returns a new directory /tmp/gcr-NNNN, removed when the test
// ends. CRIU's image-streamer sockets live in the images dir and sun_path holds
// only 108 bytes, too few for t.TempDir's long names.
func ShortTempDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "gcr-")
	if err != nil {
		t.Fatalf("short temp dir: %v", err)
	}
	t.Cleanup(func() {
		if err := os.RemoveAll(dir); err != nil {
			t.Errorf("remove %s: %v", dir, err)
		}
	})
	return dir
}

// RunCRIU runs criu with args. On failure the error holds criu's output and,
// when the args name a log file (-o/--log-file) and its directory
// (-W/--work-dir, else -D/--images-dir, where CRIU writes logs by default),
// the log's error lines and tail.
func RunCRIU(ctx context.Context, t testing.TB, args ...string) error {
	t.Helper()
	bin := CRIU(t)
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.WaitDelay = 5 * time.Second
	start := time.Now()
	out, err := cmd.CombinedOutput()
	elapsed := time.Since(start).Round(time.Millisecond)
	if err == nil {
		t.Logf("criu %s: ok in %v", strings.Join(args, " "), elapsed)
		return nil
	}
	msg := fmt.Sprintf("criu %s (after %v): %v", strings.Join(args, " "), elapsed, err)
	if s := strings.TrimSpace(string(out)); s != "" {
		msg += "\noutput:\n" + s
	}
	if logPath := criuLogPath(args); logPath != "" {
		if b, rerr := os.ReadFile(logPath); rerr == nil {
			msg += fmt.Sprintf("\nerrors in %s:\n%s\ntail of %s:\n%s", logPath, errorLines(b, 20), logPath, tail(b, 30))
		} else {
			msg += fmt.Sprintf("\nno log: %v", rerr)
		}
	}
	return errors.New(msg)
}

// criuLogPath mirrors CRIU's rule: a relative log file is in the work dir,
// which defaults to the images dir.
func criuLogPath(args []string) string {
	var logFile, imagesDir, workDir string
	for i := 0; i < len(args); i++ {
		a := args[i]
		val := func() string {
			if k, v, ok := strings.Cut(a, "="); ok && strings.HasPrefix(k, "--") {
				return v
			}
			if i+1 < len(args) {
				i++
				return args[i]
			}
			return ""
		}
		switch name, _, _ := strings.Cut(a, "="); name {
		case "-o", "--log-file":
			logFile = val()
		case "-D", "--images-dir":
			imagesDir = val()
		case "-W", "--work-dir":
			workDir = val()
		}
	}
	if logFile == "" || logFile == "-" {
		return ""
	}
	if filepath.IsAbs(logFile) {
		return logFile
	}
	if workDir == "" {
		workDir = imagesDir
	}
	if workDir == "" {
		return ""
	}
	return filepath.Join(workDir, logFile)
}

func errorLines(b []byte, n int) string {
	var lines []string
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if strings.Contains(sc.Text(), "Error") {
			lines = append(lines, sc.Text())
		}
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func tail(b []byte, n int) string {
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Proof is the target's report written to DIR/proof.json on SIGUSR1 (the
// same fields as in e2e/target).
type Proof struct {
	PID              int    `json:"pid"`
	Counter          uint64 `json:"counter"`
	ChecksumExpected string `json:"checksum_expected"`
	ChecksumActual   string `json:"checksum_actual"`
	ChildPID         int    `json:"child_pid"`
	ChildAlive       bool   `json:"child_alive"`
	ChildLastValue   uint64 `json:"child_last_value"`
	ChildReceived    uint64 `json:"child_received"`
	Seq              uint64 `json:"seq"`
	MemoryBytes      int    `json:"memory_bytes"`
	HugeTLBBytes     int    `json:"hugetlb_bytes,omitempty"`
	TCPBytes         int64  `json:"tcp_bytes,omitempty"`
	Error            string `json:"error,omitempty"`
	Time             string `json:"time"`
}

// Verify checks the proof on its own: memory intact, child alive, no error.
func (p Proof) Verify() error {
	var errs []error
	if p.ChecksumExpected == "" || p.ChecksumActual != p.ChecksumExpected {
		errs = append(errs, fmt.Errorf("memory checksum %q, expected %q", p.ChecksumActual, p.ChecksumExpected))
	}
	if !p.ChildAlive {
		errs = append(errs, fmt.Errorf("child %d not alive", p.ChildPID))
	}
	if p.Error != "" {
		errs = append(errs, fmt.Errorf("target reports: %s", p.Error))
	}
	return errors.Join(errs...)
}

// Check verifies p and that the process went on from prev (an earlier proof,
// e.g. from before a checkpoint): same pids and memory, counter and child
// advanced.
func (p Proof) Check(prev Proof) error {
	errs := []error{p.Verify()}
	if p.PID != prev.PID || p.ChildPID != prev.ChildPID {
		errs = append(errs, fmt.Errorf("pids %d/%d, before %d/%d", p.PID, p.ChildPID, prev.PID, prev.ChildPID))
	}
	if p.ChecksumExpected != prev.ChecksumExpected {
		errs = append(errs, fmt.Errorf("expected checksum changed from %s to %s", prev.ChecksumExpected, p.ChecksumExpected))
	}
	if p.Counter <= prev.Counter {
		errs = append(errs, fmt.Errorf("counter %d did not advance past %d", p.Counter, prev.Counter))
	}
	if p.ChildLastValue <= prev.ChildLastValue {
		errs = append(errs, fmt.Errorf("child value %d did not advance past %d", p.ChildLastValue, prev.ChildLastValue))
	}
	return errors.Join(errs...)
}

// Target is a running e2e/target process tree (the target and its child).
type Target struct {
	t        testing.TB
	dir      string
	bin      string
	pid      int
	childPID int
	waited   chan struct{} // closed when the originally started process is reaped
}

var subreaperOnce sync.Once

// becomeSubreaper makes orphans come to the test process instead of init:
// a target's child after a dump kills the target, and the restored tree
// after criu restore -d exits. We reap them (WaitPIDGone), so pids are free
// for the next restore (a dead session leader's pid stays taken while a
// zombie of its session is left) and no zombie outlives its test; init
// here reaps late.
func becomeSubreaper(t testing.TB) {
	subreaperOnce.Do(func() {
		if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
			t.Logf("PR_SET_CHILD_SUBREAPER: %v (orphans go to init)", err)
		}
	})
}

// StartTarget builds and starts e2e/target in dir with about mb MiB of
// memory, in its own session with stdin on /dev/null and output in
// dir/target.out, as CRIU needs to dump it without --shell-job, and waits
// until it is ready. The target tree is killed when the test ends, also
// after a restore (CRIU restores the same pids).
func StartTarget(t testing.TB, dir string, mb int, extra ...string) *Target {
	t.Helper()
	becomeSubreaper(t)
	bin := BuildBinary(t, "./e2e/target")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatalf("target dir: %v", err)
	}
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatalf("open %s: %v", os.DevNull, err)
	}
	defer devNull.Close()
	out, err := os.OpenFile(filepath.Join(dir, "target.out"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatalf("target output: %v", err)
	}
	defer out.Close()

	cmd := exec.Command(bin, append([]string{"--dir", dir, "--mb", strconv.Itoa(mb)}, extra...)...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = devNull, out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start target: %v", err)
	}
	tg := &Target{t: t, dir: dir, bin: bin, pid: cmd.Process.Pid, waited: make(chan struct{})}
	// Reaps the target after criu dump kills it; its pid stays taken (a
	// zombie) until then, and restore would fail with "File exists".
	go func() {
		cmd.Wait()
		close(tg.waited)
	}()
	t.Cleanup(tg.Kill)

	readyTimeout := time.Minute + time.Duration(mb)*50*time.Millisecond
	deadline := time.Now().Add(readyTimeout)
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "ready")); err == nil {
			if pid, _ := strconv.Atoi(strings.TrimSpace(string(b))); pid == tg.pid {
				break
			}
		}
		select {
		case <-tg.waited:
			t.Fatalf("target exited before ready: %s\n%s", cmd.ProcessState, tg.outputTail())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("target not ready after %v\n%s", readyTimeout, tg.outputTail())
		}
		time.Sleep(20 * time.Millisecond)
	}
	tg.childPID = childOf(tg.pid)
	if tg.childPID == 0 {
		t.Fatalf("target %d has no child process\n%s", tg.pid, tg.outputTail())
	}
	t.Logf("target pid %d child %d (%d MiB) in %s", tg.pid, tg.childPID, mb, dir)
	return tg
}

// childOf reads the children of every thread, since a Go program forks from
// whichever thread runs the goroutine.
func childOf(pid int) int {
	files, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if fs := strings.Fields(string(b)); len(fs) > 0 {
			if c, err := strconv.Atoi(fs[0]); err == nil {
				return c
			}
		}
	}
	return 0
}

// PID is the target's pid, for criu dump -t.
func (tg *Target) PID() int { return tg.pid }

// ChildPID is the pid of the target's child process.
func (tg *Target) ChildPID() int { return tg.childPID }

// Dir is the target's work directory.
func (tg *Target) Dir() string { return tg.dir }

func (tg *Target) outputTail() string {
	var s strings.Builder
	for _, name := range []string{"target.out", "target.log"} {
		if b, err := os.ReadFile(filepath.Join(tg.dir, name)); err == nil {
			fmt.Fprintf(&s, "--- %s:\n%s\n", name, tail(b, 15))
		}
	}
	return s.String()
}

// Threads describes each thread of the target and its child: state, the
// syscall it is in and where the kernel has it waiting, for a failure
// message about a process that stopped advancing.
func (tg *Target) Threads() string {
	var s strings.Builder
	for _, pid := range []int{tg.pid, tg.childPID} {
		tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*", pid))
		for _, task := range tasks {
			stat, _ := os.ReadFile(filepath.Join(task, "stat"))
			state := "?"
			if i := bytes.LastIndexByte(stat, ')'); i >= 0 && i+2 < len(stat) {
				state = string(stat[i+2])
			}
			sc, _ := os.ReadFile(filepath.Join(task, "syscall"))
			wchan, _ := os.ReadFile(filepath.Join(task, "wchan"))
			fmt.Fprintf(&s, "%s: state %s wchan %s syscall %s\n", task, state, wchan, bytes.TrimSpace(sc))
		}
	}
	return s.String()
}

// ProveIntact fails the test unless the target proves itself intact and
// gone on since *last (ProveAdvanced), and makes that proof the new *last.
func (tg *Target) ProveIntact(ctx context.Context, t testing.TB, last *Proof) {
	t.Helper()
	p, err := tg.ProveAdvanced(ctx, *last)
	if err != nil {
		t.Fatal(err)
	}
	*last = p
}

// advanceWithin is how long a proof may keep showing the counter or the
// child where they were: on a loaded machine a healthy target's 10 ms
// tickers can miss the few tens of milliseconds between two proofs (CI saw
// it once), while a stuck one never catches up.
const advanceWithin = 5 * time.Second

// ProveAdvanced asks for proofs until one passes Check against prev, for up
// to advanceWithin; a proof that fails Verify (memory, child) fails at once.
func (tg *Target) ProveAdvanced(ctx context.Context, prev Proof) (Proof, error) {
	deadline := time.Now().Add(advanceWithin)
	for {
		p, err := tg.Prove(ctx)
		if err != nil {
			return p, err
		}
		if err := p.Verify(); err != nil {
			return p, err
		}
		err = p.Check(prev)
		if err == nil {
			return p, nil
		}
		if time.Now().After(deadline) {
			return p, fmt.Errorf("for %v: %w\n%s%s", advanceWithin, err, tg.Threads(), tg.outputTail())
		}
		tg.t.Logf("target %d, proof %d: %v; asking again", tg.pid, p.Seq, err)
		select {
		case <-ctx.Done():
			return p, fmt.Errorf("%w: %w", err, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Prove asks the target for a proof (SIGUSR1) and returns it once written.
// The old proof.json is removed first, so whatever appears is the answer to
// this request even when the target was restored from an older checkpoint
// and its seq went back.
func (tg *Target) Prove(ctx context.Context) (Proof, error) {
	path := filepath.Join(tg.dir, "proof.json")
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return Proof{}, fmt.Errorf("remove old proof: %w", err)
	}
	if err := syscall.Kill(tg.pid, syscall.SIGUSR1); err != nil {
		return Proof{}, fmt.Errorf("signal target %d: %w", tg.pid, err)
	}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		b, err := os.ReadFile(path)
		if err == nil {
			var p Proof
			if err := json.Unmarshal(b, &p); err != nil {
				return Proof{}, fmt.Errorf("parse %s: %w", path, err)
			}
			return p, nil
		}
		if !errors.Is(err, os.ErrNotExist) {
			return Proof{}, fmt.Errorf("read proof: %w", err)
		}
		if !pidRunning(tg.pid) {
			return Proof{}, fmt.Errorf("target %d died before answering\n%s", tg.pid, tg.outputTail())
		}
		select {
		case <-ctx.Done():
			return Proof{}, fmt.Errorf("waiting for proof from %d: %w\n%s", tg.pid, ctx.Err(), tg.outputTail())
		case <-tick.C:
		}
	}
}

// Rewrite makes the target rewrite a tenth of its memory (SIGUSR2) and
// waits until it has.
func (tg *Target) Rewrite(ctx context.Context) error {
	path := filepath.Join(tg.dir, "rewritten")
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if err := syscall.Kill(tg.pid, syscall.SIGUSR2); err != nil {
		return fmt.Errorf("signal target %d: %w", tg.pid, err)
	}
	for {
		if _, err := os.Stat(path); err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for target %d to rewrite its memory: %w\n%s", tg.pid, ctx.Err(), tg.outputTail())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// WaitGone waits until the target and its child are gone (reaped), as criu
// restore needs after criu dump killed them.
func (tg *Target) WaitGone(ctx context.Context) error {
	for _, pid := range []int{tg.pid, tg.childPID} {
		if err := WaitPIDGone(ctx, pid); err != nil {
			return err
		}
	}
	return nil
}

// Kill kills the target tree and waits briefly for it to go. Only processes
// still running our target binary are signalled, so that a pid reused after
// the target died is left alone.
func (tg *Target) Kill() {
	var killed []int
	for _, pid := range []int{tg.pid, tg.childPID} {
		if pid > 0 && isOurBinary(pid, tg.bin) && syscall.Kill(pid, syscall.SIGKILL) == nil {
			killed = append(killed, pid)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, pid := range killed {
		if err := WaitPIDGone(ctx, pid); err != nil {
			tg.t.Logf("kill target: %v", err)
		}
	}
}

func isOurBinary(pid int, bin string) bool {
	exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
	return err == nil && (exe == bin || strings.TrimSuffix(exe, " (deleted)") == bin)
}

// WaitPIDGone waits until pid has left /proc. A zombie still holds its pid,
// so it also reaps pid when it is our child (or an orphan handed to us as
// subreaper).
func WaitPIDGone(ctx context.Context, pid int) error {
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		var ws unix.WaitStatus
		unix.Wait4(pid, &ws, unix.WNOHANG, nil)
		if !pidExists(pid) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("pid %d still present (%s): %w", pid, procState(pid), ctx.Err())
		case <-tick.C:
		}
	}
}

func pidExists(pid int) bool {
	_, err := os.Stat(fmt.Sprintf("/proc/%d", pid))
	return err == nil
}

// pidRunning is false for zombies too.
func pidRunning(pid int) bool {
	s := procState(pid)
	return s != "" && s != "Z" && s != "X"
}

func procState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) {
		return s[i+2 : i+3]
	}
	return ""
}
