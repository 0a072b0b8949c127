package e2e

// The images CRIU reads as files (issue 39, criusock/asfile.go). In stream
// mode CRIU lost a network namespace's netfilter rules (it sizes
// nftables-N.img with fstat: 0 for a pipe), restored TCP connections
// without its network lock (whose rules travel in that image) and failed
// on a mapping of huge pages (its restorer preadv()s the pages image).
// Each case runs through capture | serve with CRIU run by the test,
// through checkpoint and restore, and through a migration, stream-restored
// and lazily (the lazy restore writes the images into a directory, so
// CRIU reads files there anyway: the same checks, the other way).

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// fileCase is a process CRIU restores from an image it reads as a file.
type fileCase struct {
	name       string
	targetArgs []string
	criuArgs   []string
	// prepare runs before the target starts in namespace ns.
	prepare func(t *testing.T, ns string)
	check   func(t *testing.T, r restoredCase)
}

// restoredCase is what a case's check looks at.
type restoredCase struct {
	pid    int
	before string // the target's namespace's rules before the dump
	log    string // CRIU's restore log
	seen   string // the restored namespace's rules at CRIU's post-restore
	after  Proof
}

const hugeMB = 4

var fileCases = []fileCase{
	{
		name: "netfilter",
		prepare: func(t *testing.T, ns string) {
			for _, args := range [][]string{
				{"nft", "add", "table", "inet", "gcs39"},
				{"nft", "add", "chain", "inet", "gcs39", "input", "{ type filter hook input priority 0; policy accept; }"},
				{"nft", "add", "rule", "inet", "gcs39", "input", "tcp", "dport", "4242", "counter", "drop"},
				{"iptables", "-A", "INPUT", "-p", "tcp", "--dport", "4343", "-j", "DROP"}, // iptables-nft
			} {
				inNetnsRun(t, "/run/netns/"+ns, args...)
			}
		},
		check: func(t *testing.T, r restoredCase) {
			if after := netfilterRules(t, fmt.Sprintf("/proc/%d/ns/net", r.pid)); after != r.before {
				t.Errorf("rules after the restore differ:\n%s\nbefore:\n%s", after, r.before)
			}
		},
	},
	{
		name:       "tcp-lock",
		targetArgs: []string{"--tcp-pair"},
		criuArgs:   []string{"--tcp-established"},
		check: func(t *testing.T, r restoredCase) {
			// post-restore runs once every socket is restored and before
			// CRIU's unlock: the lock must be there, as it was on dump.
			if !strings.Contains(r.seen, "chain CRIU {") && !strings.Contains(r.seen, "table inet CRIU-") {
				t.Errorf("no network lock (CRIU's iptables chain or nftables table) in the restored namespace at post-restore:\n%s", r.seen)
			}
			for _, bad := range []string{"Bad rule", "nft command error", "Can't restore not-sent", "Unable to set window"} {
				if strings.Contains(r.log, bad) {
					t.Errorf("criu's restore log says %q", bad)
				}
			}
			if r.after.TCPBytes == 0 {
				t.Errorf("no bytes through the restored connection: %+v", r.after)
			}
		},
	},
	{
		name:       "hugetlb",
		targetArgs: []string{"--hugetlb", strconv.Itoa(hugeMB)},
		prepare:    func(t *testing.T, _ string) { reserveHugePages(t, hugeMB<<20) },
		check: func(t *testing.T, r restoredCase) {
			if r.after.HugeTLBBytes != hugeMB<<20 {
				t.Errorf("restored target holds %d bytes of huge pages, want %d", r.after.HugeTLBBytes, hugeMB<<20)
			}
		},
	},
}

// restorePath dumps a target and restores it one way; it returns the
// restored PID and CRIU's restore log.
type restorePath func(ctx context.Context, t *testing.T, c fileCase, tg *Target, script string) (pid int, log string)

func TestFilesThroughCaptureServe(t *testing.T) { runFileCases(t, throughCaptureServe) }
func TestFilesThroughCheckpoint(t *testing.T)   { runFileCases(t, throughCheckpoint) }
func TestFilesThroughMigration(t *testing.T)    { runFileCases(t, throughMigration(nil)) }
func TestFilesThroughLazyMigration(t *testing.T) {
	runFileCases(t, throughMigration([]string{"--lazy-pages"}))
}

func runFileCases(t *testing.T, path restorePath) {
	CRIU(t)
	NeedTool(t, "nft")
	NeedTool(t, "iptables")
	NeedTool(t, "nsenter")
	for _, c := range fileCases {
		t.Run(c.name, func(t *testing.T) {
			ctx := testCtx(t)
			dir := ShortTempDir(t)
			ns := NewNetns(t)
			if c.prepare != nil {
				c.prepare(t, ns)
			}
			var tg *Target
			var before Proof
			InNetns(t, ns, func() { tg, before = startedTarget(ctx, t, dir, 16, c.targetArgs...) })
			r := restoredCase{before: netfilterRules(t, "/run/netns/"+ns)}
			seen := filepath.Join(dir, "seen.txt")
			script := rulesAtPostRestore(t, dir, seen)
			var log string
			r.pid, log = path(ctx, t, c, tg, script)
			r.log = log
			b, _ := os.ReadFile(seen)
			r.seen = string(b)
			if r.pid != tg.PID() {
				t.Fatalf("restored pid %d, want %d", r.pid, tg.PID())
			}
			after, err := tg.Prove(ctx)
			if err != nil {
				t.Fatalf("proof after restore: %v", err)
			}
			if err := after.Check(before); err != nil {
				t.Fatalf("restored target: %v", err)
			}
			r.after = after
			c.check(t, r)
		})
	}
}

func throughCaptureServe(ctx context.Context, t *testing.T, c fileCase, tg *Target, script string) (int, string) {
	dir := filepath.Dir(tg.Dir())
	streamPath := filepath.Join(dir, "ckpt.stream")
	out, err := os.Create(streamPath)
	if err != nil {
		t.Fatal(err)
	}
	a := mkdir(t, filepath.Join(dir, "a"))
	capture := startGCS(ctx, t, gcsOpts{stdout: out}, "--images-dir", a, "capture")
	if !capture.waitLine(ctx, "socket-init") {
		t.Fatalf("capture ended before listening: %v", capture.wait(ctx))
	}
	args := append([]string{"dump", "--stream", "-D", a, "-t", strconv.Itoa(tg.PID()), "-o", "dump.log", "-v4"}, c.criuArgs...)
	if err := RunCRIU(ctx, t, args...); err != nil {
		t.Fatalf("criu dump --stream: %v (capture: %v)", err, capture.wait(ctx))
	}
	if err := capture.wait(ctx); err != nil {
		t.Fatalf("capture: %v", err)
	}
	out.Close()
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatalf("after dump: %v", err)
	}
	in, err := os.Open(streamPath)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	b := mkdir(t, filepath.Join(dir, "b"))
	serve := startGCS(ctx, t, gcsOpts{stdin: in}, "--images-dir", b, "serve")
	if !serve.waitLine(ctx, "socket-init") {
		t.Fatalf("serve ended before listening: %v", serve.wait(ctx))
	}
	pidfile := filepath.Join(dir, "restored.pid")
	args = append([]string{"restore", "--stream", "-D", b, "--restore-detached", "--pidfile", pidfile,
		"-o", "restore.log", "-v4", "--action-script", script}, c.criuArgs...)
	criuErr := RunCRIU(ctx, t, args...)
	if serveErr := serve.wait(ctx); criuErr != nil || serveErr != nil {
		t.Fatalf("restore: criu: %v; serve: %v", criuErr, serveErr)
	}
	return readPIDFile(t, pidfile), readLog(filepath.Join(b, "restore.log"))
}

func throughCheckpoint(ctx context.Context, t *testing.T, c fileCase, tg *Target, script string) (int, string) {
	dir := filepath.Dir(tg.Dir())
	archive := filepath.Join(dir, "ck")
	gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", archive, "--criu-opts", strings.Join(c.criuArgs, " ")).ok(t, "checkpoint")
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatal(err)
	}
	work := mkdir(t, filepath.Join(dir, "work"))
	r := gcsRun(ctx, t, "restore", "--from", archive, "--work-dir", work,
		"--criu-opts", strings.Join(append([]string{"--action-script", script}, c.criuArgs...), " ")).ok(t, "restore")
	pid, _ := strconv.Atoi(strings.TrimSpace(r.stdout))
	return pid, readLog(filepath.Join(work, "img", "restore.log"))
}

// throughMigration migrates to a receiver that restores, with recvArgs.
func throughMigration(recvArgs []string) restorePath {
	return func(ctx context.Context, t *testing.T, c fileCase, tg *Target, script string) (int, string) {
		e := newMigrateEnv(t)
		work := mkdir(t, filepath.Join(e.dir, "work"))
		var res migrateJSON
		e.migrated(tg, append([]string{"--work-dir", work, "--criu-opts", strings.Join(append([]string{"--action-script", script}, c.criuArgs...), " ")}, recvArgs...),
			[]string{"--criu-opts", strings.Join(c.criuArgs, " ")}, &res, nil)
		return res.RestoredPID, readLog(filepath.Join(work, "img", "restore.log"))
	}
}

// rulesAtPostRestore writes an action script that saves the rules of the
// restored tree's network namespace into seen at CRIU's post-restore.
func rulesAtPostRestore(t *testing.T, dir, seen string) string {
	t.Helper()
	path := filepath.Join(dir, "rules-at-post-restore.sh")
	script := fmt.Sprintf(`#!/bin/sh
[ "$CRTOOLS_SCRIPT_ACTION" = post-restore ] || exit 0
exec %s -t "$CRTOOLS_INIT_PID" -n sh -c '%s list ruleset; %s -S' > %s 2>&1
`, NeedTool(t, "nsenter"), NeedTool(t, "nft"), NeedTool(t, "iptables"), seen)
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

// netfilterRules lists the test's nft table and every iptables rule of
// the network namespace at nsPath.
func netfilterRules(t *testing.T, nsPath string) string {
	t.Helper()
	nft, _ := inNetnsOutput(t, nsPath, "nft", "list", "table", "inet", "gcs39")
	ipt := inNetnsRun(t, nsPath, "iptables", "-S")
	return nft + "\n" + ipt
}

// inNetnsRun runs a tool inside the namespace at nsPath, failing the test
// on error, and returns its output.
func inNetnsRun(t *testing.T, nsPath string, args ...string) string {
	t.Helper()
	out, err := inNetnsOutput(t, nsPath, args...)
	if err != nil {
		t.Fatalf("%s in %s: %v: %s", strings.Join(args, " "), nsPath, err, out)
	}
	return out
}

func inNetnsOutput(t *testing.T, nsPath string, args ...string) (string, error) {
	t.Helper()
	var out []byte
	var err error
	InNetnsAt(t, nsPath, func() { out, err = exec.Command(NeedTool(t, args[0]), args[1:]...).CombinedOutput() })
	return string(out), err
}

// reserveHugePages adds huge pages of bytes to the pool for the test's
// time, and two more: CRIU learns the hugetlb device by mapping a huge page
// of its own when it starts (kerndat), and with the pool empty (the target
// holding all of it) it takes the target's mapping for a file on an
// unknown mount ("Can't lookup mount=... /anon_hugepage (deleted)").
func reserveHugePages(t *testing.T, bytes int) {
	t.Helper()
	const nr = "/proc/sys/vm/nr_hugepages"
	b, err := os.ReadFile(nr)
	if err != nil {
		missing(t, "huge pages: %v", err)
	}
	n := bytes/hugePageSize(t) + 2
	was, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	if err := os.WriteFile(nr, []byte(strconv.Itoa(was+n)), 0); err != nil {
		missing(t, "reserve %d huge pages: %v", n, err)
	}
	t.Cleanup(func() { os.WriteFile(nr, []byte(strconv.Itoa(was)), 0) })
	b, _ = os.ReadFile(nr)
	if now, _ := strconv.Atoi(strings.TrimSpace(string(b))); now < was+n {
		missing(t, "reserve %d huge pages: the pool holds %d, want %d (memory too fragmented?)", n, now, was+n)
	}
}

// hugePageSize is the default huge page size (/proc/meminfo).
func hugePageSize(t *testing.T) int {
	t.Helper()
	b, _ := os.ReadFile("/proc/meminfo")
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Hugepagesize:"); ok {
			kb, err := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")))
			if err == nil && kb > 0 {
				return kb << 10
			}
		}
	}
	missing(t, "no huge page size in /proc/meminfo")
	return 0
}

func readPIDFile(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("restored pid: %v", err)
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return pid
}

func readLog(path string) string {
	b, _ := os.ReadFile(path)
	return string(b)
}
