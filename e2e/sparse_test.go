package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// sparseTarget holds zero pages of every kind a sparse restore must tell
// apart (criusock/sparse.go), in a parent and a forked child that share
// them copy-on-write:
//
//	anon   32 MiB private anonymous, 0x5a before the fork; then the child
//	       zeroes its first half, the parent its second: each keeps the
//	       other's bytes where it wrote none (CRIU restores the child's
//	       inherited pages by comparing them with the parent's)
//	touched 16 MiB private anonymous, written with zeros before the fork
//	file   16 MiB of a file of 0xab bytes mapped private, written with
//	       zeros before the fork: its pages must come back zero, not
//	       read again from the file
//	random 8 MiB of random bytes, beside the zeros
//
// On SIGUSR1 each process checks every region and writes DIR/proof-parent
// or DIR/proof-child: "ok", or what was wrong.
const sparseTarget = `
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MB (1 << 20)
static volatile sig_atomic_t asked;
static void on_usr1(int s) { (void)s; asked = 1; }

static unsigned char *anon, *touched, *filemap, *random_;
static unsigned long long sum0;

static unsigned long long sum(const unsigned char *p, size_t n)
{
	unsigned long long h = 1469598103934665603ULL;
	for (size_t i = 0; i < n; i++)
		h = (h ^ p[i]) * 1099511628211ULL;
	return h;
}

/* bad is the offset of the first byte of p[0:n] that is not want, or -1. */
static long bad(const unsigned char *p, size_t n, unsigned char want)
{
	for (size_t i = 0; i < n; i++)
		if (p[i] != want)
			return (long)i;
	return -1;
}

static void prove(const char *dir, int child)
{
	char msg[256] = "ok", path[512];
	unsigned char a0 = child ? 0 : 0x5a, a1 = child ? 0x5a : 0;
	long i;
	if ((i = bad(anon, 16 * MB, a0)) >= 0)
		snprintf(msg, sizeof msg, "anon's first half reads %#x at offset %ld, want %#x", anon[i], i, a0);
	else if ((i = bad(anon + 16 * MB, 16 * MB, a1)) >= 0)
		snprintf(msg, sizeof msg, "anon's second half reads %#x at offset %ld, want %#x", anon[16 * MB + i], i, a1);
	else if ((i = bad(touched, 16 * MB, 0)) >= 0)
		snprintf(msg, sizeof msg, "touched zero pages read %#x at offset %ld", touched[i], i);
	else if ((i = bad(filemap, 16 * MB, 0)) >= 0)
		snprintf(msg, sizeof msg, "the private file mapping's zeroed pages read %#x at offset %ld (the file's bytes?)", filemap[i], i);
	else if (sum(random_, 8 * MB) != sum0)
		snprintf(msg, sizeof msg, "random bytes changed");
	snprintf(path, sizeof path, "%s/proof-%s.tmp", dir, child ? "child" : "parent");
	FILE *f = fopen(path, "w");
	if (!f)
		exit(2);
	fprintf(f, "%s\n", msg);
	fclose(f);
	char final[512];
	snprintf(final, sizeof final, "%s/proof-%s", dir, child ? "child" : "parent");
	rename(path, final);
}

int main(int argc, char **argv)
{
	const char *dir = argv[1];
	char path[512];
	snprintf(path, sizeof path, "%s/backing", dir);
	int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
	unsigned char *ab = malloc(16 * MB);
	memset(ab, 0xab, 16 * MB);
	if (fd < 0 || write(fd, ab, 16 * MB) != 16 * MB)
		return 3;
	anon = mmap(NULL, 32 * MB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	touched = mmap(NULL, 16 * MB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	random_ = mmap(NULL, 8 * MB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	filemap = mmap(NULL, 16 * MB, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
	if (anon == MAP_FAILED || touched == MAP_FAILED || random_ == MAP_FAILED || filemap == MAP_FAILED)
		return 4;
	close(fd);
	memset(anon, 0x5a, 32 * MB);
	memset(touched, 0, 16 * MB);
	memset(filemap, 0, 16 * MB);
	srand(7);
	for (size_t i = 0; i < 8 * MB; i++)
		random_[i] = rand();
	sum0 = sum(random_, 8 * MB);
	signal(SIGUSR1, on_usr1);
	pid_t pid = fork();
	if (pid < 0)
		return 5;
	int child = pid == 0;
	if (child)
		memset(anon, 0, 16 * MB);
	else
		memset(anon + 16 * MB, 0, 16 * MB);
	snprintf(path, sizeof path, "%s/ready-%s", dir, child ? "child" : "parent");
	close(open(path, O_WRONLY | O_CREAT, 0644));
	for (;;) {
		if (asked) {
			asked = 0;
			prove(dir, child);
			if (!child)
				kill(pid, SIGUSR1);
		}
		usleep(10000);
	}
}
`

// TestSparseRestore: a restore leaves the zero pages of private anonymous
// memory out of what CRIU reads, and every kind of page comes back as it
// was: the zeros a parent and its child wrote over each other's shared
// pages, touched zero pages, and zeroed pages of a private file mapping,
// which must not be read again from the file. The restore must have left
// zero bytes out (sparse_bytes), or it proves nothing.
func TestSparseRestore(t *testing.T) {
	CRIU(t)
	cc, err := exec.LookPath("cc")
	if err != nil {
		missing(t, "no C compiler (cc) for the target")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := ShortTempDir(t)
	src, bin := filepath.Join(dir, "sparse.c"), filepath.Join(dir, "sparse")
	if err := os.WriteFile(src, []byte(sparseTarget), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(cc, "-O2", "-o", bin, src).CombinedOutput(); err != nil {
		t.Fatalf("cc: %v\n%s", err, out)
	}
	tdir := filepath.Join(dir, "t")
	if err := os.MkdirAll(tdir, 0o755); err != nil {
		t.Fatal(err)
	}
	becomeSubreaper(t)
	cmd := exec.Command(bin, tdir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go cmd.Wait()
	pid := cmd.Process.Pid
	t.Cleanup(func() { syscall.Kill(-pid, syscall.SIGKILL) })
	for end := time.Now().Add(20 * time.Second); !fileExists(filepath.Join(tdir, "ready-parent")) || !fileExists(filepath.Join(tdir, "ready-child")); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("the target did not get ready within 20 s")
		}
	}
	prove := func(when string) {
		t.Helper()
		for _, w := range []string{"parent", "child"} {
			os.Remove(filepath.Join(tdir, "proof-"+w))
		}
		if err := syscall.Kill(pid, syscall.SIGUSR1); err != nil {
			t.Fatalf("%s: signal the target: %v", when, err)
		}
		for _, w := range []string{"parent", "child"} {
			var b []byte
			for end := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				if b, err = os.ReadFile(filepath.Join(tdir, "proof-"+w)); err == nil {
					break
				}
				if time.Now().After(end) {
					t.Fatalf("%s: no proof from the %s within 10 s", when, w)
				}
			}
			if got := strings.TrimSpace(string(b)); got != "ok" {
				t.Fatalf("%s: the %s says: %s", when, w, got)
			}
		}
	}
	prove("before the checkpoint")
	child := childOf(pid)
	archive := filepath.Join(dir, "ck")
	gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(pid), "--to", archive).ok(t, "checkpoint")
	for _, p := range []int{pid, child} {
		if err := WaitPIDGone(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	r := gcsRun(ctx, t, "restore", "--from", archive, "--json").ok(t, "restore")
	var res struct {
		PID         int   `json:"pid"`
		SparseBytes int64 `json:"sparse_bytes"`
	}
	if err := json.NewDecoder(bytes.NewReader([]byte(r.stdout))).Decode(&res); err != nil || res.PID != pid {
		t.Fatalf("restore printed %q (want pid %d): %v", r.stdout, pid, err)
	}
	prove("after the restore")
	// Both processes' zero halves of anon and the parent's touched pages
	// at least (the child's are its parent's, shared): 16 + 16 + 16 MiB,
	// less what a chunk boundary cuts off at each end of a run.
	if res.SparseBytes < 40<<20 {
		t.Fatalf("the restore left out %d zero bytes, want at least 40 MiB: sparse pages did not run", res.SparseBytes)
	}
	t.Logf("left out %d MiB of zero pages", res.SparseBytes>>20)
}
