package e2e

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
)

// Issue 24, part 1, without a GPU: what the driver cannot undo is refused
// before any GPU step, and CRIU's network lock is one this host has.

// onewayTarget is a CPU-only program that looks, to /proc, like what the
// tests want: "nccl" loads the fake CUDA driver and a library named
// libnccl.so.2 and maps an NCCL-named /dev/shm segment, as an NCCL rank
// does; "tcp" holds a loopback TCP connection to itself and sends over it.
// Both count in DIR/count, which the tests watch advance.
const onewayTarget = `
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

static void put(const char *dir, const char *name, long v)
{
	char p[4096], t[4096];
	snprintf(p, sizeof p, "%s/%s", dir, name);
	snprintf(t, sizeof t, "%s.tmp", p);
	FILE *f = fopen(t, "w");
	if (!f)
		exit(2);
	fprintf(f, "%ld\n", v);
	fclose(f);
	rename(t, p);
}

int main(int argc, char **argv)
{
	if (argc != 5)
		return 2;
	const char *dir = argv[1], *mode = argv[2];
	int a = -1, b = -1;
	if (!strcmp(mode, "nccl")) {
		if (!dlopen(argv[3], RTLD_NOW) || !dlopen(argv[4], RTLD_NOW)) {
			fprintf(stderr, "dlopen: %s\n", dlerror());
			return 3;
		}
		char shm[] = "/dev/shm/nccl-XXXXXX";
		int fd = mkstemp(shm);
		if (fd < 0 || ftruncate(fd, 1 << 20) || mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) == MAP_FAILED)
			return 4;
		unlink(shm);
		close(fd);
	} else {
		struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
		socklen_t n = sizeof sa;
		int l = socket(AF_INET, SOCK_STREAM, 0);
		if (bind(l, (void *)&sa, sizeof sa) || listen(l, 1) || getsockname(l, (void *)&sa, &n))
			return 5;
		a = socket(AF_INET, SOCK_STREAM, 0);
		if (connect(a, (void *)&sa, sizeof sa) || (b = accept(l, NULL, NULL)) < 0)
			return 6;
		close(l);
	}
	put(dir, "ready", getpid());
	for (long i = 1;; i++) {
		if (a >= 0) {
			char c = 'x';
			if (write(a, &c, 1) != 1 || read(b, &c, 1) != 1 || c != 'x')
				return 7;
		}
		put(dir, "count", i);
		usleep(10000);
	}
}
`

type onewayEnv struct {
	gcs, criu, dir, target, fakeLib, ncclLib, state string
}

func setupOneway(t *testing.T) *onewayEnv {
	t.Helper()
	criu := CRIU(t)
	cc, err := exec.LookPath("cc")
	if err != nil {
		missing(t, "no C compiler (cc) for the target and the fake driver")
	}
	dir := ShortTempDir(t)
	e := &onewayEnv{gcs: BuildBinary(t, "./cmd/gpucr-stream"), criu: criu, dir: dir, target: filepath.Join(dir, "oneway"),
		fakeLib: filepath.Join(dir, "lib", "libcuda.so.1"), ncclLib: filepath.Join(dir, "lib", "libnccl.so.2"), state: filepath.Join(dir, "cudastate")}
	src := filepath.Join(dir, "oneway.c")
	empty := filepath.Join(dir, "empty.c")
	for _, d := range []string{filepath.Dir(e.fakeLib), e.state} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(src, []byte(onewayTarget), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(empty, []byte("int gpucr_not_nccl;\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, s := range [][]string{
		{cc, "-O2", "-fPIC", "-shared", "-o", e.fakeLib, filepath.Join(ModuleRoot(t), "preload", "testdata", "fake_cuda.c")},
		{cc, "-O2", "-fPIC", "-shared", "-o", e.ncclLib, empty},
		{cc, "-O2", "-o", e.target, src, "-ldl"},
	} {
		if out, err := exec.Command(s[0], s[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v\n%s", s, err, out)
		}
	}
	return e
}

func (e *onewayEnv) env() []string {
	return append(os.Environ(), "GPUCR_LIBCUDA="+e.fakeLib, "GPUCR_FAKE_CUDA_STATE="+e.state)
}

// start runs the target in mode in its own session, as CRIU wants it.
func (e *onewayEnv) start(t *testing.T, mode string) (pid int, tdir string) {
	t.Helper()
	tdir = filepath.Join(e.dir, mode)
	if err := os.MkdirAll(tdir, 0o755); err != nil {
		t.Fatal(err)
	}
	out, err := os.Create(filepath.Join(tdir, "out"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	cmd := exec.Command(e.target, tdir, mode, e.fakeLib, e.ncclLib)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-done })
	for end := time.Now().Add(10 * time.Second); !fileExists(filepath.Join(tdir, "ready")); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(end) {
			b, _ := os.ReadFile(filepath.Join(tdir, "out"))
			t.Fatalf("target not ready: %s", b)
		}
	}
	return cmd.Process.Pid, tdir
}

// advances checks that the target's counter moves on within 5 s, and that
// its process runs (not stopped by CRIU's freezer or ptrace).
func advances(t *testing.T, pid int, tdir string) {
	t.Helper()
	read := func() int {
		b, _ := os.ReadFile(filepath.Join(tdir, "count"))
		n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
		return n
	}
	first := read()
	for end := time.Now().Add(5 * time.Second); read() <= first+10; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("process %d (state %s) counted %d, then no further in 5 s", pid, procState(pid), read())
		}
	}
	if s := procState(pid); s == "T" || s == "t" || s == "Z" {
		t.Fatalf("process %d is in state %s", pid, s)
	}
}

// TestNCCLRefusedBeforeFreeze: a CPU-only process that loads a CUDA driver
// (the fake one) and maps libnccl.so.2 and an NCCL /dev/shm segment looks
// like an NCCL rank, and `checkpoint --cuda on` and `--cuda auto` refuse it
// before anything: the driver never locked it, CRIU never ran, nothing was
// committed, and it counts on.
func TestNCCLRefusedBeforeFreeze(t *testing.T) {
	e := setupOneway(t)
	ctx := testCtx(t)
	pid, tdir := e.start(t, "nccl")
	advances(t, pid, tdir)
	for _, mode := range []string{"on", "auto"} {
		ar := filepath.Join(e.dir, "ar-"+mode)
		work := filepath.Join(e.dir, "w-"+mode)
		cmd := exec.CommandContext(ctx, e.gcs, "checkpoint", "--pid", strconv.Itoa(pid), "--to", ar, "--cuda", mode,
			"--criu", e.criu, "--work-dir", work, "--no-progress")
		cmd.Env = e.env()
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 {
			t.Fatalf("--cuda %s: %v, want exit 1: %s", mode, err, out)
		}
		for _, s := range []string{"process " + strconv.Itoa(pid) + " is an NCCL rank", "libnccl.so.2", "/dev/shm/nccl-", "runs on, untouched"} {
			if !strings.Contains(string(out), s) {
				t.Errorf("--cuda %s: the refusal lacks %q: %s", mode, s, out)
			}
		}
		if fileExists(filepath.Join(e.state, strconv.Itoa(pid))) {
			b, _ := os.ReadFile(filepath.Join(e.state, strconv.Itoa(pid)))
			t.Fatalf("--cuda %s: the fake driver's state of %d was written (%q): it was locked", mode, pid, b)
		}
		if fileExists(filepath.Join(work, "img", "dump.log")) {
			t.Fatalf("--cuda %s: criu ran", mode)
		}
		if fileExists(filepath.Join(ar, manifest.ManifestName)) {
			t.Fatalf("--cuda %s: a refused checkpoint left a manifest", mode)
		}
		advances(t, pid, tdir)
	}
}

// TestNetworkLockChosen: a process holding a loopback TCP connection is
// checkpointed with --tcp-established, CRIU locking the connection with
// the method this host has (here nftables through criu's libnftables where
// iptables is missing: criu's default, iptables, failed the dump after the
// freeze), and restored; the restored process goes on talking over it.
func TestNetworkLockChosen(t *testing.T) {
	e := setupOneway(t)
	ctx := testCtx(t)
	pid, tdir := e.start(t, "tcp")
	advances(t, pid, tdir)
	ar := filepath.Join(e.dir, "ar")
	out, err := exec.CommandContext(ctx, e.gcs, "checkpoint", "--pid", strconv.Itoa(pid), "--to", ar, "--criu", e.criu,
		"--work-dir", filepath.Join(e.dir, "w"), "--criu-opts", "--tcp-established", "--no-progress").CombinedOutput()
	if err != nil {
		t.Fatalf("checkpoint: %v: %s", err, out)
	}
	if err := WaitPIDGone(ctx, pid); err != nil {
		t.Fatal(err)
	}
	out, err = exec.CommandContext(ctx, e.gcs, "restore", "--from", ar, "--criu", e.criu, "--work-dir", filepath.Join(e.dir, "w2"),
		"--criu-opts", "--tcp-established", "--no-progress").CombinedOutput()
	if err != nil {
		t.Fatalf("restore: %v: %s", err, out)
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	advances(t, pid, tdir)
}
