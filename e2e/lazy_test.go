package e2e

import (
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestMigrateLazyPages migrates a target between two network namespaces
// to a receiver that restores with CRIU's lazy pages (receive
// --lazy-pages), with and without pre-copy: the restored target proves
// its memory, counter and child, its downtime ends where it ran, before
// its last page was in, and the receiver says how long it ran so.
func TestMigrateLazyPages(t *testing.T) {
	for _, precopy := range []string{"off", "on"} {
		t.Run("precopy="+precopy, func(t *testing.T) {
			e := newMigrateEnv(t)
			tg, before := e.startTarget("target", 128, "--rewrite-pct", "5")
			var res migrateJSON
			var rres struct {
				PID         int     `json:"pid"`
				LazyPages   bool    `json:"lazy_pages"`
				RunningSecs float64 `json:"running_seconds"`
				Phases      []struct {
					Name string  `json:"name"`
					Secs float64 `json:"seconds"`
				} `json:"phases"`
			}
			e.migrated(tg, []string{"--lazy-pages"}, []string{"--streams", "2", "--precopy", precopy}, &res, &rres)
			if res.RestoredPID != tg.PID() || rres.PID != tg.PID() || !rres.LazyPages || res.DowntimeTo != "running (lazy pages)" {
				t.Fatalf("migrate says %+v, receive says %+v, target pid %d", res, rres, tg.PID())
			}
			var names []string
			for _, p := range rres.Phases {
				names = append(names, p.Name)
			}
			if !strings.Contains(strings.Join(names, ","), "criu restore --lazy-pages") {
				t.Fatalf("receiver phases %v", names)
			}
			provenRestore(e.ctx, t, tg, before)
			t.Logf("downtime %.2fs; the process ran %.3fs before its last page was in; receiver phases %+v", res.DowntimeSecs, rres.RunningSecs, rres.Phases)
		})
	}
}

// TestMigrateLazyPagesDaemonDies: the lazy-pages daemon dies right after
// CRIU's restore, before it has handed in the pages. The receiver kills
// the restored tree (it would fault on memory that never comes) and says
// so; the sender keeps its image, from which a restore brings the target
// back whole.
func TestMigrateLazyPagesDaemonDies(t *testing.T) {
	e := newMigrateEnv(t)
	tg, before := e.startTarget("target", 128)
	keep := mkdir(t, filepath.Join(e.dir, "keep"))
	t.Setenv("GPUCR_TEST_FAULT", "lazy-pages")
	e.recvBin = HooksBinary(t)
	recv := e.startReceiver(nil, "--restore", "--lazy-pages", "--criu", e.criu)
	m := e.migrate(tg, io.Discard, "--keep-dir", keep)
	err := m.wait(e.ctx)
	if err == nil || !strings.Contains(err.Error(), "restore on the receiver failed") || !strings.Contains(err.Error(), "criu lazy-pages failed") {
		t.Fatalf("migrate with the lazy-pages daemon killed: %v", err)
	}
	rerr := recv.wait(e.ctx)
	if rerr == nil || !strings.Contains(rerr.Error(), "the restored tree was killed") {
		t.Fatalf("receiver: %v", rerr)
	}
	e.restoreKept(tg, before, err, keep)
}

// TestReceiveLazyPagesUnsupported: a receiver whose criu cannot restore
// with lazy pages (here: its check says the kernel lacks userfaultfd's
// events) refuses at its start, before any sender stops a process for it.
func TestReceiveLazyPagesUnsupported(t *testing.T) {
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	noUffd := filepath.Join(dir, "criu-no-uffd")
	script := "#!/bin/sh\n[ \"$1\" = check ] && { echo 'uffd-noncoop is not supported' >&2; exit 1; }\nexec " + CRIU(t) + " \"$@\"\n"
	if err := os.WriteFile(noUffd, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	bin := BuildBinary(t, "./cmd/gpucr-stream")
	tokFile := writeToken(t, bin, filepath.Join(dir, "token"))
	out, err := exec.CommandContext(ctx, bin, "receive", "--listen", "127.0.0.1:0", "--restore", "--lazy-pages", "--criu", noUffd,
		"--token-file", tokFile).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "criu check --feature uffd-noncoop") || strings.Contains(string(out), "socket-init") {
		t.Fatalf("receive --lazy-pages with a criu that cannot: %v: %s", err, out)
	}
}
