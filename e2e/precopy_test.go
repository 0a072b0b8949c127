package e2e

import (
	"bytes"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// migratePrecopyJSON is the part of migrate --json that pre-copy adds.
type migratePrecopyJSON struct {
	migrateJSON
	Precopy struct {
		Method string `json:"method"`
		Why    string `json:"why"`
		Rounds []struct {
			Secs      float64 `json:"seconds"`
			RawBytes  int64   `json:"raw_bytes"`
			SentBytes int64   `json:"sent_bytes"`
		} `json:"rounds"`
		FinalWireBytes int64 `json:"final_wire_bytes"`
		FinalRefBytes  int64 `json:"final_ref_bytes"`
	} `json:"precopy"`
}

// TestMigratePrecopy migrates a running target with pre-copy between two
// network namespaces, real CRIU on both sides: the rounds send its memory
// while it runs, the final dump sends by reference what did not change
// (nearly all of it when the target only counts; most of it when it
// rewrites 5% of its pages a second), the restored target proves its
// memory (page by page where it rewrites), counter and child, and the
// receiver freed its cache.
func TestMigratePrecopy(t *testing.T) {
	for _, rewrite := range []string{"0", "5"} {
		t.Run("rewrite="+rewrite, func(t *testing.T) { migratePrecopy(t, rewrite) })
	}
}

func migratePrecopy(t *testing.T, rewrite string) {
	e := newMigrateEnv(t)
	tg, before := e.startTarget("target", 96, "--rewrite-pct", rewrite)
	var res migratePrecopyJSON
	var rres struct {
		PID          int   `json:"pid"`
		CachedChunks int   `json:"cached_chunks"`
		CachedBytes  int64 `json:"cached_bytes"`
	}
	e.migrated(tg, nil, []string{"--streams", "2", "--precopy", "on"}, &res, &rres)
	if res.RestoredPID != tg.PID() || rres.PID != tg.PID() {
		t.Fatalf("migrate says %+v, receive says %+v, target pid %d", res, rres, tg.PID())
	}
	p := res.Precopy
	if p.Method != "criu dump --leave-running" || p.Why == "" || len(p.Rounds) == 0 {
		t.Fatalf("pre-copy did not run: %+v", res)
	}
	if p.Rounds[0].SentBytes < 8<<20 || rres.CachedChunks == 0 || rres.CachedBytes < p.Rounds[0].SentBytes {
		t.Errorf("the first round sent %d bytes, the receiver cached %d chunks, %d bytes", p.Rounds[0].SentBytes, rres.CachedChunks, rres.CachedBytes)
	}
	// Little changed: the final dump sent much less than the first round,
	// and most of the image by reference.
	if p.FinalWireBytes > p.Rounds[0].SentBytes/3 || p.FinalRefBytes < p.Rounds[0].SentBytes/2 {
		t.Errorf("final dump: %d bytes on the wire, %d by reference; the first round sent %d", p.FinalWireBytes, p.FinalRefBytes, p.Rounds[0].SentBytes)
	}
	provenRestore(e.ctx, t, tg, before)
	t.Logf("downtime %.2fs; rounds %+v; final %d bytes on the wire, %d by reference; %s", res.DowntimeSecs, p.Rounds, p.FinalWireBytes, p.FinalRefBytes, p.Why)
}

// lineWatch is a writer that closes seen once what was written contains
// want.
type lineWatch struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	want string
	seen chan struct{}
}

func (w *lineWatch) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if w.seen != nil && strings.Contains(w.buf.String(), w.want) {
		close(w.seen)
		w.seen = nil
	}
	return len(p), nil
}

// TestMigratePrecopyFinalFails cuts the link, or kills the receiver,
// once the pre-copy rounds are over, during the final dump: CRIU resumes
// the source, which runs on intact in its namespace; the receiver restores
// nothing and leaves no file behind.
func TestMigratePrecopyFinalFails(t *testing.T) {
	for _, how := range []string{"veth-down", "receiver-killed"} {
		t.Run(how, func(t *testing.T) {
			e := newMigrateEnv(t)
			e.net.Shape(t, "200mbit")
			tmp := mkdir(t, filepath.Join(e.dir, "tmp"))
			keep := mkdir(t, filepath.Join(e.dir, "keep"))
			tg, before := e.startTarget("target", 64)
			t.Setenv("TMPDIR", tmp) // the receiver's spill and CRIU's files
			var rout bytes.Buffer
			recv := e.startReceiver(&rout, "--restore", "--criu", e.criu, "--memory-limit", "16MiB")
			watch := &lineWatch{want: "pre-copy round 1:", seen: make(chan struct{})}
			seen := watch.seen
			e.migrateStderr = watch
			m := e.migrate(tg, io.Discard, "--streams", "2", "--keep-dir", keep, "--precopy", "on", "--precopy-rounds", "1")
			select {
			case <-seen:
			case <-m.done:
				t.Fatalf("migration ended before its pre-copy round did: %v", m.wait(e.ctx))
			}
			if how == "veth-down" {
				e.net.Cut(t)
			} else {
				recv.cmd.Process.Kill()
			}
			err := m.wait(e.ctx)
			if err == nil {
				t.Fatal("migrate succeeded with its final dump cut off")
			}
			if !strings.Contains(err.Error(), "not migrated and keeps running here") || strings.Contains(err.Error(), fmt.Sprintf("migrate %d: pre-copy round", tg.PID())) {
				t.Errorf("migrate does not say its final dump failed and the process runs on: %v", err)
			}
			rerr := recv.wait(e.ctx)
			if how == "veth-down" && (rerr == nil || !strings.Contains(rerr.Error(), "nothing is restored")) {
				t.Errorf("receiver: %v", rerr)
			}
			after, perr := tg.Prove(e.ctx)
			if perr != nil {
				t.Fatalf("target after the failed migration: %v", perr)
			}
			if err := after.Check(before); err != nil {
				t.Fatalf("target after the failed migration: %v", err)
			}
			if in, err := NetnsOf(tg.PID(), e.net.A); err != nil || !in {
				t.Errorf("target left namespace %s: %v", e.net.A, err)
			}
			// The cache spilled beyond 16 MiB into an unlinked file: nothing
			// of it, or of the image, stays.
			noImageData(t, tmp, "gcs-")
			onlyKeptCRIULogs(t, tmp, err.Error())
			emptyDir(t, keep)
			t.Logf("%s: %v", how, err)
		})
	}
}
