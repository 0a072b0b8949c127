package e2e

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Eight `gpucr-stream checkpoint` runs of eight processes, all to one
// --to, at once: exactly one commits; the seven others fail before CRIU's
// post-dump step lets the process go, so CRIU resumes them, and they remove
// their segments. Both used to print "checkpoint done" and exit 0, CRIU
// killed every process, and only the manifest committed last was left
// (over segments the others had overwritten).
//
// A pre-dump action script holds every CRIU until all eight captures have
// started (each has checked the destination by then), so that all eight
// race to the commit and none is turned away by that first check.

const racers = 8

func TestConcurrentCheckpointsDir(t *testing.T) {
	CRIU(t)
	dir := ShortTempDir(t)
	dest := filepath.Join(dir, "ck")
	raceCheckpoints(t, dir, dest, dir, "ck", func(ctx context.Context, segments int) {
		// On disk: the manifest and the segments it names, nothing else
		// (no other capture's segment, no temporary file).
		var files []string
		filepath.WalkDir(dest, func(p string, d fs.DirEntry, err error) error {
			if err == nil && !d.IsDir() {
				rel, _ := filepath.Rel(dest, p)
				files = append(files, rel)
			}
			return nil
		})
		if len(files) != segments+1 {
			t.Errorf("%s holds %d files for a checkpoint of %d segments: %v", dest, len(files), segments, files)
		}
	})
}

func TestConcurrentCheckpointsS3(t *testing.T) {
	e := startS3(t)
	dir := ShortTempDir(t)
	raceCheckpoints(t, dir, e.url("race"), e.url(""), "race", func(ctx context.Context, segments int) {
		if keys := e.keys(ctx, t, "race/"); len(keys) != segments+1 {
			t.Errorf("the bucket holds %d objects for a checkpoint of %d segments: %v", len(keys), segments, keys)
		}
		if ups := e.uploads(ctx, t, "race/"); len(ups) != 0 {
			t.Errorf("incomplete uploads left: %v", ups)
		}
	})
}

// holdScript is a CRIU action script that, at pre-dump, says it arrived
// and waits for the go file.
const holdScript = `#!/bin/sh
[ "$CRTOOLS_SCRIPT_ACTION" = pre-dump ] || exit 0
touch "%[1]s/arrived.$$"
while [ ! -e "%[1]s/go" ]; do sleep 0.02; done
`

// raceCheckpoints runs the race into dest, whose checkpoint ls lists as
// name under parent, and checks its outcome; stored checks what the store
// holds, given how many segments the checkpoint has.
func raceCheckpoints(t *testing.T, dir, dest, parent, name string, stored func(ctx context.Context, segments int)) {
	ctx := testCtx(t)
	bin := BuildBinary(t, "./cmd/gpucr-stream")
	hold := mkdir(t, filepath.Join(dir, "hold"))
	script := filepath.Join(dir, "hold.sh")
	if err := os.WriteFile(script, []byte(fmt.Sprintf(holdScript, hold)), 0o755); err != nil {
		t.Fatal(err)
	}
	targets := make([]*Target, racers)
	before := make([]Proof, racers)
	for i := range targets {
		targets[i], before[i] = startedTarget(ctx, t, filepath.Join(dir, fmt.Sprintf("t%d", i)), 16)
	}

	type result struct {
		code           int
		stdout, stderr string
	}
	results := make([]result, racers)
	var wg sync.WaitGroup
	exited := make(chan int, racers)
	for i, tg := range targets {
		cmd := exec.CommandContext(ctx, bin, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", dest, "--json",
			"--work-dir", filepath.Join(dir, fmt.Sprintf("w%d", i)), "--criu-opts", "--action-script "+script)
		var stdout, stderr strings.Builder
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			cmd.Wait()
			results[i] = result{code: cmd.ProcessState.ExitCode(), stdout: stdout.String(), stderr: stderr.String()}
			exited <- i
		})
	}
	defer wg.Wait()

	// Every CRIU is held at pre-dump, its capture started: let them go.
	for {
		arrived, _ := filepath.Glob(filepath.Join(hold, "arrived.*"))
		if len(arrived) == racers {
			break
		}
		select {
		case i := <-exited:
			wg.Wait()
			t.Fatalf("checkpoint %d ended before every CRIU reached pre-dump (%d did): exit %d\n%s", i, len(arrived), results[i].code, results[i].stderr)
		case <-ctx.Done():
			t.Fatalf("only %d of %d CRIUs reached pre-dump", len(arrived), racers)
		case <-time.After(20 * time.Millisecond):
		}
	}
	if err := os.WriteFile(filepath.Join(hold, "go"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	wg.Wait()

	winner := -1
	for i, r := range results {
		t.Logf("checkpoint %d (pid %d): exit %d", i, targets[i].PID(), r.code)
		switch {
		case r.code == 0 && winner >= 0:
			t.Errorf("checkpoints %d and %d both succeeded", winner, i)
		case r.code == 0:
			winner = i
		case !strings.Contains(r.stderr, "a checkpoint was committed at "+dest+" by another capture meanwhile") ||
			!strings.Contains(r.stderr, "criu resumed the process"):
			t.Errorf("checkpoint %d: exit %d without saying another capture committed first:\n%s", i, r.code, r.stderr)
		}
	}
	if winner < 0 {
		t.Fatalf("no checkpoint succeeded:\n%s", results[0].stderr)
	}
	t.Logf("a loser's message:\n%s", results[(winner+1)%racers].stderr)
	if t.Failed() {
		t.FailNow()
	}
	// The seven losers were never killed: the same processes went on.
	for i, tg := range targets {
		if i != winner {
			tg.ProveIntact(ctx, t, &before[i])
		}
	}

	items := ls(ctx, t, parent)
	if len(items) != 1 {
		t.Fatalf("ls lists %d checkpoints, want one: %+v", len(items), items)
	}
	it, ok := items[name]
	if !ok || it.Error != "" || it.Segments < 1 {
		t.Fatalf("ls: %+v", items)
	}
	stored(ctx, it.Segments)
	if gc := gcsRun(ctx, t, "gc", "--older-than", "0s", "--dry-run", "--json", parent).ok(t, "gc"); !strings.Contains(gc.stdout, `"objects":0`) {
		t.Errorf("gc would remove something: %s", gc.stdout)
	}
	gcsRun(ctx, t, "verify", dest).ok(t, "verify")

	// The one checkpoint is the winner's, and restores it.
	w := targets[winner]
	if err := w.WaitGone(ctx); err != nil {
		t.Fatal(err)
	}
	rr := gcsRun(ctx, t, "restore", "--from", dest, "--work-dir", filepath.Join(dir, "wr")).ok(t, "restore")
	if pid, _ := strconv.Atoi(strings.TrimSpace(rr.stdout)); pid != w.PID() {
		t.Fatalf("restore printed %q, want the winner's pid %d", rr.stdout, w.PID())
	}
	provenRestore(ctx, t, w, before[winner])
	for i, tg := range targets {
		if i != winner && !pidRunning(tg.PID()) {
			t.Errorf("target %d (pid %d) is gone", i, tg.PID())
		}
	}
}
