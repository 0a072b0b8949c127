package criusock

// Interruptions. CRIU runs in a process group of its own, so a terminal's
// Ctrl-C reaches gpucr-stream alone: CRIU killed in the middle of a dump
// leaves its parasite (a /memfd:CRIUMFD mapping) in the process it
// resumes, and every later checkpoint carries it. Interrupted, gpucr-stream
// fails the dump instead (it closes CRIU's pipes and fails the post-dump
// action), and CRIU cures and resumes the process itself; only a CRIU that
// outlives InterruptGrace is killed. The error then says what became of
// the process.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/proc"
)

// InterruptGrace is how long CRIU is given, once the work it serves was
// interrupted, to fail and clean up by itself (cure and resume a dumped
// process, kill a half-restored one) before it is killed.
var InterruptGrace = 30 * time.Second

// errCRIUKilled is a CRIU killed past InterruptGrace.
var errCRIUKilled = errors.New("criu killed")

// parasiteMapping is what CRIU's parasite maps into a process it dumps
// (compel's memfd); a cured process no longer maps it.
const parasiteMapping = "/memfd:CRIUMFD"

// runCRIU runs criu with args, its output kept for the error message. When
// ctx ends first, criu is not killed at once: the caller's work has failed
// its streams, so criu fails too and cleans up; only after InterruptGrace
// is it killed (errCRIUKilled). Its process group is its own, except for a
// restore of a shell job, whose restored tree joins criu's group and so
// stays in the terminal's.
func runCRIU(ctx context.Context, criu string, args []string, hooks Hooks) (out string, took time.Duration, err error) {
	start := time.Now()
	cmd := exec.Command(criu, args...)
	var b bytes.Buffer
	cmd.Stdout, cmd.Stderr = &b, &b
	ownGroup := !(len(args) > 0 && args[0] == "restore" && (slices.Contains(args, "--shell-job") || slices.Contains(args, "-j")))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: ownGroup}
	// An action script criu leaves behind must not hold its output open
	// for good.
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		return "", 0, err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-ctx.Done():
		hooks.log(fmt.Sprintf("%v: waiting up to %v for criu to stop and clean up", context.Cause(ctx), InterruptGrace))
		grace := time.NewTimer(InterruptGrace)
		defer grace.Stop()
		select {
		case err = <-done:
		case <-grace.C:
			if ownGroup {
				syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // criu and its action script
			} else {
				cmd.Process.Kill()
			}
			<-done
			err = fmt.Errorf("%w: it did not stop within %v", errCRIUKilled, InterruptGrace)
		}
	}
	return b.String(), time.Since(start), err
}

// interrupted is the error of work that ctx's end stopped: what stopped
// it, wrapping errdefs.ErrInterrupted, then what it left.
func interrupted(ctx context.Context, format string, args ...any) error {
	cause := context.Cause(ctx)
	if !errors.Is(cause, errdefs.ErrInterrupted) {
		cause = fmt.Errorf("%w (%w)", errdefs.ErrInterrupted, cause)
	}
	return fmt.Errorf("%w: %s", cause, fmt.Sprintf(format, args...))
}

// treeState says what became of the process tree of pid after a dump that
// did not complete: running (and whether CRIU's parasite is left in any
// of its processes), stopped, or gone.
func treeState(pid int) string {
	var state string
	switch st := proc.State(pid); st {
	case 0:
		return fmt.Sprintf("process %d is gone", pid)
	case 'Z', 'X':
		return fmt.Sprintf("process %d is dead (not yet reaped by its parent)", pid)
	case 'T', 't':
		state = fmt.Sprintf("process %d is stopped (state %c): `kill -CONT %d` lets it run", pid, st, pid)
	default:
		state = fmt.Sprintf("process %d runs on", pid)
	}
	tree, _ := proc.Tree(pid)
	var marked []string
	for _, p := range tree {
		if slices.Contains(proc.MappedFiles(p), parasiteMapping) {
			marked = append(marked, strconv.Itoa(p))
		}
	}
	if len(marked) > 0 {
		return fmt.Sprintf("%s, but CRIU's parasite may be left in it (process %s maps %s): a later checkpoint carries it; restart the process to be rid of it",
			state, strings.Join(marked, ", "), parasiteMapping)
	}
	return state + ", with no CRIU mapping left in it"
}
