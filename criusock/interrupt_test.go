package criusock

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/testwait"
)

// fakeCRIU writes a script standing in for criu: it ignores SIGINT and
// SIGTERM, as a CRIU that must not die half-way would be treated, starts
// a child, writes "PID PGID CHILD" to dir/started, and then runs body.
func fakeCRIU(t *testing.T, dir, body string) string {
	t.Helper()
	p := filepath.Join(dir, "criu")
	script := fmt.Sprintf(`#!/bin/sh
trap '' INT TERM
sleep 1000 &
echo "$$ $(ps -o pgid= -p $$ | tr -d ' ') $!" > %s/started.tmp
mv %s/started.tmp %s/started
%s
`, dir, dir, dir, body)
	if err := os.WriteFile(p, []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
	return p
}

// started waits for the fake criu's line and returns its numbers.
func started(ctx context.Context, t *testing.T, dir string) (pid, pgid, child int) {
	t.Helper()
	for {
		b, err := os.ReadFile(filepath.Join(dir, "started"))
		if err == nil {
			if _, err := fmt.Sscan(string(b), &pid, &pgid, &child); err != nil {
				t.Fatalf("started: %q: %v", b, err)
			}
			return
		}
		select {
		case <-ctx.Done():
			t.Fatal("the fake criu never started")
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// TestRunCRIUInterrupted: criu runs in a process group of its own (a
// terminal's Ctrl-C does not reach it); when ctx ends it is given
// InterruptGrace to end by itself, and one that does keeps its own exit
// status; one that does not is killed with its whole group.
func TestRunCRIUInterrupted(t *testing.T) {
	if _, err := exec.LookPath("ps"); err != nil {
		t.Fatal("ps is needed")
	}
	for _, tc := range []struct {
		name   string
		body   string // after the start line
		grace  time.Duration
		killed bool
	}{
		// Ends once its input is gone, as CRIU ends when its pipes close.
		{"ends by itself", `read -r line < "$(dirname "$0")/stop"; exit 3`, time.Hour, false},
		{"outlives the grace", `wait`, time.Millisecond, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			stop := filepath.Join(dir, "stop")
			if err := syscall.Mkfifo(stop, 0o600); err != nil {
				t.Fatal(err)
			}
			criu := fakeCRIU(t, dir, tc.body)
			old := InterruptGrace
			InterruptGrace = tc.grace
			t.Cleanup(func() { InterruptGrace = old })
			ctx, cancel := context.WithCancelCause(context.Background())
			defer cancel(nil)
			var logged []string
			type result struct {
				out string
				err error
			}
			done := make(chan result, 1)
			go func() {
				out, _, err := runCRIU(ctx, criu, []string{"dump"}, Hooks{Log: func(s string) { logged = append(logged, s) }})
				done <- result{out, err}
			}()
			wctx, wcancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
			defer wcancel()
			pid, pgid, child := started(wctx, t, dir)
			if pgid != pid {
				t.Errorf("criu %d runs in process group %d, not its own", pid, pgid)
			}
			cancel(fmt.Errorf("%w by SIGINT", errdefs.ErrInterrupted))
			if !tc.killed {
				// What the caller does on an interrupt: CRIU's input goes.
				f, err := os.OpenFile(stop, os.O_WRONLY, 0)
				if err != nil {
					t.Fatal(err)
				}
				fmt.Fprintln(f, "gone")
				f.Close()
			}
			r := <-done
			if got := errors.Is(r.err, errCRIUKilled); got != tc.killed {
				t.Fatalf("killed %v, want %v (err %v)", got, tc.killed, r.err)
			}
			var ee *exec.ExitError
			if !tc.killed && (!errors.As(r.err, &ee) || ee.ExitCode() != 3) {
				t.Fatalf("criu's own exit status is lost: %v", r.err)
			}
			if len(logged) != 1 || !strings.Contains(logged[0], "interrupted by SIGINT: waiting up to") {
				t.Errorf("logged %q", logged)
			}
			if tc.killed {
				// The whole group went: criu's child too.
				for st := proc.State(child); st != 0 && st != 'Z'; st = proc.State(child) {
					select {
					case <-wctx.Done():
						t.Fatalf("criu's child %d outlived it", child)
					case <-time.After(5 * time.Millisecond):
					}
				}
			} else {
				syscall.Kill(child, syscall.SIGKILL)
			}
		})
	}
}

// TestCommitterInterrupted: an interrupt while the commit runs answers the
// post-dump action at once, with the interrupt, so that CRIU resumes the
// process; the commit is still waited for.
func TestCommitterInterrupted(t *testing.T) {
	cm, err := newCommitter(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer cm.close()
	ctx, cancel := context.WithCancelCause(context.Background())
	release := make(chan struct{})
	commitDone := false
	type result struct {
		cut bool
		err error
	}
	done := make(chan result, 1)
	go func() {
		cut, err := cm.commit(ctx, func() error {
			<-release // a commit that takes its time to see ctx's end
			commitDone = true
			return context.Cause(ctx)
		})
		done <- result{cut, err}
	}()
	cancel(fmt.Errorf("%w by SIGTERM", errdefs.ErrInterrupted))
	answer, err := bufio.NewReader(cm.res).ReadString('\n')
	if err != nil || answer != "interrupted by SIGTERM\n" {
		t.Fatalf("answer %q, %v", answer, err)
	}
	close(release)
	r := <-done
	if !r.cut || !errors.Is(r.err, errdefs.ErrInterrupted) || !commitDone {
		t.Fatalf("cut %v, err %v, commit done %v", r.cut, r.err, commitDone)
	}
}

// TestTreeState: what an interrupted dump says of the process.
func TestTreeState(t *testing.T) {
	cmd := exec.Command("sleep", "1000")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	if got := treeState(pid); got != fmt.Sprintf("process %d runs on, with no CRIU mapping left in it", pid) {
		t.Errorf("running: %q", got)
	}
	syscall.Kill(pid, syscall.SIGSTOP)
	for st := ""; !strings.Contains(st, "stopped"); st = treeState(pid) {
		time.Sleep(time.Millisecond)
	}
	cmd.Process.Kill()
	cmd.Wait()
	if got := treeState(pid); got != fmt.Sprintf("process %d is gone", pid) {
		t.Errorf("gone: %q", got)
	}
}
