package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The GPU fast path through a migration, over loopback with the fake driver
// (fastpath_test.go): the VRAM files go in the migration stream and the
// receiver copies them in after its CRIU and driver restore; a failure
// before the commit refills the source; a restore that fails on the
// receiver leaves the sender's kept copy, from which `restore` brings the
// device memory back too; a migrate killed after the release leaves the
// library to refill the source.

// startReceiver runs `receive --listen 127.0.0.1:0 --restore` with the fast
// path's environment (and env) and waits until it listens.
func (e *fastEnv) startReceiver(ctx context.Context, t *testing.T, env []string, tok string, args ...string) *receiver {
	t.Helper()
	cmd := exec.CommandContext(ctx, e.gcs, append([]string{"receive", "--listen", "127.0.0.1:0", "--token-file", tok, "--net-timeout", "3s",
		"--restore", "--json", "--no-progress"}, args...)...)
	cmd.Env = append(e.env(), env...)
	return startReceiver(t, cmd, 20*time.Second)
}

func (e *fastEnv) migrateArgs(pid int, r *receiver, tok, name string, extra ...string) []string {
	return append([]string{"migrate", "--pid", strconv.Itoa(pid), "--to", "tcp://" + r.addr, "--token-file", tok, "--net-timeout", "3s",
		"--criu", e.criu, "--work-dir", filepath.Join(e.dir, "w-"+name), "--json", "--no-progress", "--vram-files", "3", "--vram-keep-dir", e.dir}, extra...)
}

func TestFastPathMigrate(t *testing.T) {
	e := setupFast(t)
	ctx := testCtx(t)
	tokFile := writeToken(t, e.gcs, filepath.Join(e.dir, "token"))
	// restoreKept restores the image migrate kept (named in its error
	// migErr) and checks that the process runs with its memory.
	restoreKept := func(t *testing.T, migErr error, keep string, pid int, tdir, name string) {
		t.Helper()
		kept := regexp.MustCompile(`kept at (\S+):`).FindStringSubmatch(migErr.Error())
		if kept == nil || !strings.HasPrefix(kept[1], keep+"/") {
			t.Fatalf("migrate does not name the kept image in %s: %v", keep, migErr)
		}
		out, err := e.gcsRun(ctx, "restore", "--from", kept[1], "--criu", e.criu, "--work-dir", filepath.Join(e.dir, "w-restore-"+name), "--json", "--no-progress")
		mustRestoreFast(t, out, err, pid, tdir)
	}
	noKeptVRAM := func(t *testing.T) {
		t.Helper()
		if ents, _ := filepath.Glob(filepath.Join(e.dir, "gpucr-vram-keep-*", "*")); len(ents) != 0 {
			t.Fatalf("the fast path's kept copy is left: %v", ents)
		}
	}

	// Moved: the receiver restores the process and copies its device
	// memory in; the sender's copies (the fast path's, the image) go.
	// Encrypted: the same with --key-file on both sides (the VRAM files
	// sealed like every other file of the stream).
	key, err := e.gcsRun(ctx, "keygen")
	if err != nil {
		t.Fatal(err)
	}
	keyFile := filepath.Join(e.dir, "key")
	if err := os.WriteFile(keyFile, key, 0o600); err != nil {
		t.Fatal(err)
	}
	// With pre-copy: the device memory goes ahead while the program runs
	// (the library's peek), and the final dump sends it by reference.
	// With lazy pages on the receiver (GPUCR_LAZY_CUDA=1): the driver's
	// restore and the copy in run while the daemon hands the host memory
	// in, and the downtime ends where the process runs.
	lazy := []string{"--lazy-pages"}
	for _, tc := range []struct {
		name    string
		key     []string
		precopy []string
		recv    []string
	}{{"moved", nil, nil, nil}, {"moved encrypted", []string{"--key-file", keyFile}, nil, nil}, {"moved with pre-copy", nil, []string{"--precopy", "on"}, nil},
		{"moved with lazy pages", nil, nil, lazy}} {
		t.Run(tc.name, func(t *testing.T) {
			name := strings.ReplaceAll(tc.name, " ", "-")
			pid, tdir, waitGone := e.start(t, name)
			if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
				t.Fatalf("before: %q", r)
			}
			keep := mkdir(t, filepath.Join(e.dir, "keep-"+name))
			var env []string
			if tc.recv != nil {
				env = []string{"GPUCR_LAZY_CUDA=1"}
			}
			recv := e.startReceiver(ctx, t, env, tokFile, append(append([]string{"--criu", e.criu, "--work-dir", filepath.Join(e.dir, "rw-"+name)}, tc.key...), tc.recv...)...)
			out, err := e.gcsRun(ctx, e.migrateArgs(pid, recv, tokFile, name, append(append([]string{"--keep-dir", keep, "--streams", "2"}, tc.key...), tc.precopy...)...)...)
			if err != nil {
				t.Fatalf("migrate: %v; receiver: %v", err, recv.wait(ctx))
			}
			if err := recv.wait(ctx); err != nil {
				t.Fatalf("receive: %v", err)
			}
			var mres struct {
				phases
				RestoredPID  int     `json:"restored_pid"`
				DowntimeTo   string  `json:"downtime_to"`
				DowntimeSecs float64 `json:"downtime_seconds"`
				Precopy      struct {
					Method string `json:"method"`
					Rounds []struct {
						RawBytes  int64 `json:"raw_bytes"`
						SentBytes int64 `json:"sent_bytes"`
					} `json:"rounds"`
					FinalRefBytes int64 `json:"final_ref_bytes"`
				} `json:"precopy"`
			}
			downtimeTo := "restored"
			if tc.recv != nil {
				downtimeTo = "running (lazy pages)"
			}
			if err := json.Unmarshal(out, &mres); err != nil || mres.RestoredPID != pid || mres.DowntimeTo != downtimeTo ||
				!mres.has("vram copy out") || !mres.has("vram release") || !mres.has("gpu checkpoint") {
				t.Fatalf("migrate took no fast path or did not restore: %s (%v)", out, err)
			}
			if pc := mres.Precopy; tc.precopy != nil &&
				(!strings.HasPrefix(pc.Method, "device memory") || len(pc.Rounds) == 0 || pc.Rounds[0].SentBytes == 0 || pc.FinalRefBytes < pc.Rounds[0].RawBytes/2) {
				t.Fatalf("pre-copy did not send the device memory ahead, or the final dump sent it again: %+v", pc)
			}
			var rres phases
			if err := json.Unmarshal([]byte(recv.stdout.String()), &rres); err != nil || rres.PID != pid || !rres.has("vram copy in") || !rres.has("gpu restore") {
				t.Fatalf("receive: %s (%v)", recv.stdout.String(), err)
			}
			waitGone() // the source, reaped here
			t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
			if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
				t.Fatalf("after the migration: %q", r)
			}
			emptyDir(t, keep)
			noKeptVRAM(t)
			t.Logf("downtime %.3fs; migrate phases %+v; receive phases %+v", mres.DowntimeSecs, mres.Phases, rres.Phases)
		})
	}

	// CRIU fails on the sender after the release: the source's driver
	// state and device memory come back, it runs on, and the receiver
	// restores nothing.
	t.Run("criu fails on the sender", func(t *testing.T) {
		pid, tdir, _ := e.start(t, "sendfail")
		keep := mkdir(t, filepath.Join(e.dir, "keep-sendfail"))
		recv := e.startReceiver(ctx, t, nil, tokFile, "--criu", e.criu)
		out, err := e.gcsRun(ctx, e.migrateArgs(pid, recv, tokFile, "sendfail", "--keep-dir", keep, "--criu-opts", "--no-such-criu-option")...)
		if err == nil || !strings.Contains(err.Error(), "keeps running here") || !strings.Contains(err.Error(), "restored and unlocked") ||
			!strings.Contains(err.Error(), "GPU fast path: ") {
			t.Fatalf("migrate with a failing criu (after the fast path's release): %v %s", err, out)
		}
		if rerr := recv.wait(ctx); rerr == nil || !strings.Contains(rerr.Error(), "nothing is restored") {
			t.Fatalf("receiver: %v", rerr)
		}
		if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
			t.Fatalf("after the failed migration: %q", r)
		}
		emptyDir(t, keep)
		noKeptVRAM(t)
	})

	// The receiver cannot hold the stream (its spill directory is gone):
	// it refuses it in the middle, and the source runs on with its memory.
	t.Run("receiver refuses", func(t *testing.T) {
		pid, tdir, _ := e.start(t, "recvfail")
		keep := mkdir(t, filepath.Join(e.dir, "keep-recvfail"))
		recv := e.startReceiver(ctx, t, nil, tokFile, "--criu", e.criu, "--memory-limit", "1MiB", "--spill-dir", filepath.Join(e.dir, "no-such-dir"))
		out, err := e.gcsRun(ctx, e.migrateArgs(pid, recv, tokFile, "recvfail", "--keep-dir", keep, "--codec", "none")...)
		if err == nil || !strings.Contains(err.Error(), "keeps running here") || !strings.Contains(err.Error(), "GPU fast path: ") {
			t.Fatalf("migrate (fast path) to a receiver that cannot hold it: %v %s", err, out)
		}
		if rerr := recv.wait(ctx); rerr == nil {
			t.Fatal("receiver succeeded")
		}
		if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
			t.Fatalf("after the failed migration: %q (%v)", r, err)
		}
		emptyDir(t, keep)
		noKeptVRAM(t)
	})

	// The restore fails on the receiver after the commit: the source is
	// gone, the sender keeps the image (a stream, VRAM files included),
	// and `restore` from it brings the process back with its memory.
	t.Run("restore fails on the receiver", func(t *testing.T) {
		pid, tdir, waitGone := e.start(t, "kept")
		keep := mkdir(t, filepath.Join(e.dir, "keep-kept"))
		recv := e.startReceiver(ctx, t, nil, tokFile, "--criu", criuFailingLate(t, e.dir, e.criu))
		out, err := e.gcsRun(ctx, e.migrateArgs(pid, recv, tokFile, "kept", "--keep-dir", keep)...)
		if err == nil || !strings.Contains(err.Error(), "restore on the receiver failed") {
			t.Fatalf("migrate to a failing restore: %v %s", err, out)
		}
		if rerr := recv.wait(ctx); rerr == nil {
			t.Fatal("receiver succeeded with a failing criu")
		}
		waitGone()
		noKeptVRAM(t)
		restoreKept(t, err, keep, pid, tdir, "kept")
	})

	// The copy-in fails on the receiver (it looks for the library's
	// control socket in the wrong directory): the restored process, parked
	// with no device memory, is killed there, and the sender's kept copy
	// brings it back here.
	t.Run("copy in fails on the receiver", func(t *testing.T) {
		pid, tdir, waitGone := e.start(t, "copyin")
		keep := mkdir(t, filepath.Join(e.dir, "keep-copyin"))
		recv := e.startReceiver(ctx, t, []string{"GPUCR_PRELOAD_DIR=" + filepath.Join(e.dir, "elsewhere")}, tokFile,
			"--criu", e.criu, "--work-dir", filepath.Join(e.dir, "rw-copyin"))
		out, err := e.gcsRun(ctx, e.migrateArgs(pid, recv, tokFile, "copyin", "--keep-dir", keep)...)
		if err == nil || !strings.Contains(err.Error(), "restore on the receiver failed") || !strings.Contains(err.Error(), "its device memory is not") {
			t.Fatalf("migrate to a receiver whose copy-in fails: %v %s", err, out)
		}
		if rerr := recv.wait(ctx); rerr == nil || !strings.Contains(rerr.Error(), "it was killed here") {
			t.Fatalf("receiver: %v", rerr)
		}
		waitGone()
		// The restored process (same PID) is gone too.
		if werr := WaitPIDGone(ctx, pid); werr != nil {
			t.Fatalf("the receiver's restored process: %v", werr)
		}
		// The fake driver keeps its process states by PID outside the
		// process: the receiver's restore left this PID's running, where
		// the real driver's state is in the image, checkpointed (2).
		if werr := os.WriteFile(filepath.Join(e.cudaState, strconv.Itoa(pid)), []byte("2\n"), 0o644); werr != nil {
			t.Fatal(werr)
		}
		restoreKept(t, err, keep, pid, tdir, "copyin")
	})

	// migrate killed (SIGKILL) after the release, before the driver's
	// lock: the library refills the source from the kept copy by itself
	// and it runs on; the receiver, its stream cut, restores nothing.
	t.Run("killed after the release", func(t *testing.T) {
		pid, tdir, _ := e.start(t, "killed")
		recv := e.startReceiver(ctx, t, nil, tokFile, "--criu", e.criu)
		kill := e.runPaused(ctx, t, "released", e.migrateArgs(pid, recv, tokFile, "killed", "--keep-dir", "none")...)
		kill()
		if rerr := recv.wait(ctx); rerr == nil || !strings.Contains(rerr.Error(), "nothing is restored") {
			t.Fatalf("receiver: %v", rerr)
		}
		if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
			t.Fatalf("after migrate was killed: %q", r)
		}
		status, _ := os.ReadFile(filepath.Join(e.sockDir, "preload-"+strconv.Itoa(pid)+".status"))
		if !strings.HasPrefix(string(status), "resumed") {
			t.Fatalf("the library's status %q, want resumed", status)
		}
		noKeptVRAM(t)
	})

	// --leave-running: the source gets its device memory back from the
	// fast path's kept copy right after the commit and runs on; the
	// receiver, in the same PID space, cannot restore over it.
	t.Run("leave running", func(t *testing.T) {
		pid, tdir, _ := e.start(t, "leave")
		recv := e.startReceiver(ctx, t, nil, tokFile, "--criu", e.criu)
		out, err := e.gcsRun(ctx, e.migrateArgs(pid, recv, tokFile, "leave", "--leave-running")...)
		if err == nil || !strings.Contains(err.Error(), "still running here") || !strings.Contains(err.Error(), "GPU fast path: ") {
			t.Fatalf("migrate --leave-running (fast path) into this PID space: %v %s", err, out)
		}
		if rerr := recv.wait(ctx); rerr == nil {
			t.Fatal("receiver restored a process whose PIDs are taken")
		}
		if r := fastCheck(t, tdir, 5*time.Second); !strings.HasPrefix(r, "ok ") {
			t.Fatalf("source after migrate --leave-running: %q", r)
		}
		noKeptVRAM(t)
	})
}
