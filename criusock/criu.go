package criusock

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/streamer"
)

// FindCRIU returns the criu binary to run: the given path, else criu on
// PATH, else the prefix scripts/install-criu.sh installs. A criu on PATH
// that is this program (gpucr-stream installed as criu, for runtimes that
// run "criu swrk": package swrk) is passed over.
func FindCRIU(path string) (string, error) {
	if path != "" {
		if _, err := os.Stat(path); err != nil {
			return "", fmt.Errorf("criu %s: %w", path, err)
		}
		return path, nil
	}
	if p, ok := criuOnPath(); ok {
		return p, nil
	}
	const prefix = "/opt/gpucr-criu/bin/criu"
	if _, err := os.Stat(prefix); err == nil {
		return prefix, nil
	}
	return "", errors.New("criu not found: install CRIU >= 4.0 (scripts/install-criu.sh) or pass --criu PATH")
}

// criuOnPath is the first executable criu on PATH that is not this program.
func criuOnPath() (string, bool) {
	self, err := os.Stat("/proc/self/exe")
	for _, dir := range filepath.SplitList(os.Getenv("PATH")) {
		if dir == "" {
			dir = "."
		}
		p := filepath.Join(dir, "criu")
		st, serr := os.Stat(p)
		if serr != nil || !st.Mode().IsRegular() || st.Mode().Perm()&0o111 == 0 || (err == nil && os.SameFile(st, self)) {
			continue
		}
		return p, true
	}
	return "", false
}

// actionScript is run by criu for every action. On post-dump (images
// closed, process not yet killed) it asks the image streamer to commit
// through a FIFO pair and fails unless the answer is "ok": CRIU then
// resumes the process instead of killing it, so a failed upload never
// loses it.
const actionScript = `#!/bin/sh
[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0
echo post-dump > "%[1]s/commit.req" || exit 1
read -r answer < "%[1]s/commit.res" || exit 1
[ "$answer" = ok ] || { echo "gpucr-stream: checkpoint not committed: $answer" >&2; exit 1; }
`

// committer answers the action script.
type committer struct {
	dir      string
	req, res *os.File
}

func newCommitter(dir string) (*committer, error) {
	c := &committer{dir: dir}
	for _, n := range []string{"commit.req", "commit.res"} {
		if err := syscall.Mkfifo(filepath.Join(dir, n), 0o600); err != nil {
			return nil, fmt.Errorf("action fifo: %w", err)
		}
	}
	// O_RDWR never blocks on open, and keeps the FIFOs alive whoever comes
	// first; Go polls FIFOs, so closing them wakes a blocked read.
	var err error
	if c.req, err = os.OpenFile(filepath.Join(dir, "commit.req"), os.O_RDWR, 0); err != nil {
		return nil, err
	}
	if c.res, err = os.OpenFile(filepath.Join(dir, "commit.res"), os.O_RDWR, 0); err != nil {
		c.req.Close()
		return nil, err
	}
	script := filepath.Join(dir, "action.sh")
	if err := os.WriteFile(script, []byte(fmt.Sprintf(actionScript, dir)), 0o700); err != nil {
		c.close()
		return nil, err
	}
	return c, nil
}

func (c *committer) script() string { return filepath.Join(c.dir, "action.sh") }

func (c *committer) close() {
	c.req.Close()
	c.res.Close()
}

// wait blocks until the script asks; false if it never does.
func (c *committer) wait() bool {
	line, err := bufio.NewReader(c.req).ReadString('\n')
	return err == nil && strings.TrimSpace(line) == "post-dump"
}

// commit runs fn, which must return soon once ctx ends, and answers the
// script with its result; when ctx ends first, it answers with that at
// once, so that CRIU resumes the process now, and then waits for fn. It
// returns whether the answer was ctx's end, and fn's error.
func (c *committer) commit(ctx context.Context, fn func() error) (cut bool, err error) {
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err = <-done:
		c.answer(err)
		return false, err
	case <-ctx.Done():
		c.answer(context.Cause(ctx))
		return true, <-done
	}
}

// AskCommit is the action script's side of the commit, for a CRIU whose
// post-dump reaches a program rather than the script (gpucr-stream's swrk,
// under a container runtime: package swrk): it asks the committer whose
// FIFOs are in dir and waits for its answer, nil for "ok".
func AskCommit(ctx context.Context, dir string) error {
	// Non-blocking opens: a committer that is gone is an error, not a hang.
	req, err := os.OpenFile(filepath.Join(dir, "commit.req"), os.O_WRONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return fmt.Errorf("ask for the commit: %w", err)
	}
	defer req.Close()
	res, err := os.OpenFile(filepath.Join(dir, "commit.res"), os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return fmt.Errorf("ask for the commit: %w", err)
	}
	defer res.Close()
	stop := context.AfterFunc(ctx, func() { res.Close() })
	defer stop()
	if _, err := fmt.Fprintln(req, "post-dump"); err != nil {
		return fmt.Errorf("ask for the commit: %w", err)
	}
	answer, err := bufio.NewReader(res).ReadString('\n')
	if err != nil {
		return fmt.Errorf("the commit's answer: %w", err)
	}
	if answer = strings.TrimSpace(answer); answer != "ok" {
		return fmt.Errorf("checkpoint not committed: %s", answer)
	}
	return nil
}

func (c *committer) answer(err error) {
	msg := "ok"
	if err != nil {
		msg = strings.ReplaceAll(err.Error(), "\n", " ")
	}
	fmt.Fprintln(c.res, msg)
}

// DumpOptions configure one `criu dump --stream` run.
type DumpOptions struct {
	CRIU string // binary; see FindCRIU
	PID  int
	// WorkDir holds the images dir (sockets, logs); it must be short, as
	// the socket path is limited to 108 bytes. Empty: a new temporary dir.
	WorkDir      string
	LeaveRunning bool
	ExtraArgs    []string
	Hooks        Hooks
	// BeforeKill runs from CRIU's post-dump action, after every image has
	// been drained into the capture and before CRIU kills (or resumes) the
	// process. It commits the checkpoint; its error makes CRIU fail and
	// resume the process.
	BeforeKill func(ctx context.Context, res DumpResult) error
	// Producers is the number of producer connections (VRAM dumpers) the
	// image waits for before it is complete; see IntakeOptions.
	Producers int
	// Carry are files to carry beside DefaultCarry (IntakeOptions.Carry).
	Carry []string
	// Launcher, if set, runs the dump through a container runtime
	// (launch.go) instead of `criu dump` here; PID is then the
	// container's init, for the caller.
	Launcher Launcher
	// Version is CRIU's version, being asked, for the Launcher (Launch).
	Version *VersionQuery
}

// DumpReport times the phases of a dump.
type DumpReport struct {
	DumpResult
	CRIU     time.Duration // criu dump, start to exit
	Commit   time.Duration // BeforeKill
	ImageDir string
	LogPath  string
}

// workDirs returns the work dir (a new temporary one, removed by cleanup,
// when none is given; kept short for the socket path) and its images dir.
func workDirs(workDir string) (dir, images string, cleanup func(), err error) {
	dir, cleanup = workDir, func() {}
	if dir == "" {
		if dir, err = os.MkdirTemp("", "gcs-"); err != nil {
			return "", "", nil, err
		}
		cleanup = func() { os.RemoveAll(dir) }
	}
	images = filepath.Join(dir, "img")
	if err := os.MkdirAll(images, 0o700); err != nil {
		cleanup()
		return "", "", nil, err
	}
	return dir, images, cleanup, nil
}

// criuFailed is CRIU's own failure: its log says why.
type criuFailed struct{ error }

func (e criuFailed) Unwrap() error { return e.error }

// finishWorkDir removes a temporary work dir after a success, and after a
// failure that is not CRIU's own (a destination that broke, an
// interrupt). After CRIU's own failure it keeps CRIU's logs there, and
// nothing else (no FIFOs, sockets or scripts), and the error says where;
// if CRIU wrote no log, nothing is kept.
func finishWorkDir(err error, dir string, temporary bool, cleanup func()) error {
	var cf criuFailed
	if !errors.As(err, &cf) || !temporary {
		cleanup()
		return err
	}
	logs := 0
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		switch {
		case err != nil || d.IsDir():
		case filepath.Ext(p) == ".log":
			logs++
		default:
			os.Remove(p)
		}
		return nil
	})
	if logs == 0 { // CRIU failed before it wrote one
		cleanup()
		return err
	}
	return fmt.Errorf("%w (criu's log is kept in %s; remove that directory when done)", err, dir)
}

// Dump runs `criu dump --stream` against an in-process intake feeding c,
// with the post-dump action wired to BeforeKill. It returns after CRIU
// exits; CRIU's exit code decides success. When ctx ends first, the dump
// fails rather than CRIU being killed: the intake closes CRIU's pipes and
// the post-dump action fails, so CRIU cures and resumes the process
// (runCRIU); the error wraps errdefs.ErrInterrupted and says what became
// of the process.
func Dump(ctx context.Context, o DumpOptions, c *streamer.Capture) (rep DumpReport, err error) {
	dir, images, cleanup, err := workDirs(o.WorkDir)
	if err != nil {
		return rep, err
	}
	defer func() { err = finishWorkDir(err, dir, o.WorkDir == "", cleanup) }()
	rep.ImageDir, rep.LogPath = images, filepath.Join(images, "dump.log")
	cm, err := newCommitter(dir)
	if err != nil {
		return rep, err
	}
	defer cm.close()
	carry := o.Carry
	if o.Launcher != nil {
		carry = append(slices.Clip(carry), o.Launcher.Carried()...)
	}
	in, err := StartIntakeWith(ctx, images, c, IntakeOptions{Hooks: o.Hooks, Producers: o.Producers, Carry: carry})
	if err != nil {
		return rep, err
	}
	// Answer the post-dump action.
	var commitErr error
	var cut bool // answered with ctx's end while the commit ran
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if !cm.wait() {
			return
		}
		start := time.Now()
		cut, commitErr = cm.commit(ctx, func() error {
			if o.Launcher != nil {
				if err := o.Launcher.PostDump(ctx, images); err != nil {
					return err
				}
			}
			res, err := in.Drained(ctx)
			if err == nil && o.BeforeKill != nil {
				err = o.BeforeKill(ctx, res)
			}
			return err
		})
		rep.Commit = time.Since(start)
	}()
	var out string
	criuErr := context.Cause(ctx)
	if criuErr == nil { // not interrupted before it started
		out, rep.CRIU, criuErr = runDump(ctx, o, images, cm, &rep)
	}
	// A pipeline that failed (storage down) closed CRIU's pipes: that, not
	// CRIU's broken pipe, is what the user must hear.
	pipeErr := c.Err()
	if criuErr != nil {
		// CRIU failed: make sure the intake does not wait for it.
		in.Abort(fmt.Errorf("criu dump failed: %w", criuErr))
	}
	res, inErr := in.Wait(ctx)
	cm.close() // wakes the answering goroutine if CRIU never asked
	wg.Wait()
	rep.DumpResult = res
	switch {
	case ctx.Err() != nil && (criuErr != nil || cut):
		return rep, interruptedDump(ctx, o.PID, criuErr, cut && commitErr == nil)
	case commitErr != nil:
		return rep, fmt.Errorf("commit checkpoint (criu resumed the process): %w", commitErr)
	case criuErr != nil && pipeErr != nil:
		return rep, fmt.Errorf("capture failed, so criu dump failed (criu resumed the process): %w (criu dump: %v)", pipeErr, criuErr)
	case criuErr != nil && inErr != nil && !errors.Is(inErr, criuErr):
		// The intake failed first (a producer, the pipeline) and cut CRIU off.
		return rep, fmt.Errorf("%w; so criu dump failed too: %v", inErr, criuErr)
	case criuErr != nil:
		return rep, criuFailed{fmt.Errorf("criu dump: %w; %s", criuErr, criuLogTail(rep.LogPath, out))}
	case inErr != nil:
		return rep, inErr
	case !res.Complete:
		return rep, errors.New("criu dump ended without sending inventory.img")
	}
	return rep, nil
}

// interruptedDump says what a dump that ctx's end stopped left: how CRIU
// ended, whether the checkpoint was committed all the same, and the state
// of the process.
func interruptedDump(ctx context.Context, pid int, criuErr error, committed bool) error {
	what := "criu stopped the dump"
	switch {
	case errors.Is(criuErr, errCRIUKilled):
		what = fmt.Sprintf("criu was killed in the middle of the dump (%v)", criuErr)
	case errors.Is(criuErr, context.Cause(ctx)):
		what = "criu was not started"
	}
	if committed {
		what += "; the checkpoint was committed just before, and criu resumed the process all the same"
	}
	return interrupted(ctx, "%s; %s", what, treeState(pid))
}

// interruptedRestore says what a restore that ctx's end stopped left:
// CRIU, failing, kills what it restored; one killed itself may not have.
func interruptedRestore(ctx context.Context, criuErr error) error {
	if errors.Is(criuErr, errCRIUKilled) {
		return interrupted(ctx, "criu was killed in the middle of the restore (%v): processes it restored may be left", criuErr)
	}
	return interrupted(ctx, "criu stopped the restore; nothing was restored")
}

// CRIURestoreOptions configure one `criu restore --stream` run.
type CRIURestoreOptions struct {
	CRIU      string
	WorkDir   string
	ExtraArgs []string
	Hooks     Hooks
	// Producers is the number of producer connections (VRAM restorers)
	// serving waits for; see ServeOptions.
	Producers int
	// FreePIDs bounds the wait for the PIDs the checkpoint restores to be
	// free (0: DefaultFreePIDs); see waitFreePIDs.
	FreePIDs time.Duration
	// MemoryLimit and SpillDir are ServeOptions'.
	MemoryLimit int64
	SpillDir    string
	// Carry names carried files to write into the images dir before CRIU
	// runs, waiting for them in a stream; an archive's are written anyway.
	Carry []string
	// Launcher, if set, runs the restore through a container runtime.
	Launcher Launcher
}

// RestoreReport times a restore and names the restored process.
type RestoreReport struct {
	ServeResult
	PID  int
	CRIU time.Duration
	// PIDWait is the part of CRIU that waited for the checkpoint's PIDs
	// to be free.
	PIDWait time.Duration
	LogPath string
}

// runDump runs CRIU's dump into images, here or through o.Launcher.
func runDump(ctx context.Context, o DumpOptions, images string, cm *committer, rep *DumpReport) (out string, took time.Duration, err error) {
	if o.Launcher != nil {
		l, err := o.Launcher.Dump(ctx, Launch{CRIU: o.CRIU, ImagesDir: images, WorkDir: filepath.Dir(images),
			Args: o.ExtraArgs, Commit: cm.dir, LeaveRunning: o.LeaveRunning, Version: o.Version})
		rep.LogPath = l.Log
		return l.Output, l.Took, err
	}
	reach, release, err := ReachableDir(images)
	if err != nil {
		return "", 0, err
	}
	defer release()
	args := []string{"dump", "--stream", "-D", reach, "-t", strconv.Itoa(o.PID), "-o", "dump.log", "-v4", "--action-script", cm.script()}
	if o.LeaveRunning {
		args = append(args, "--leave-running")
	}
	return runCRIU(ctx, o.CRIU, append(args, o.ExtraArgs...), o.Hooks)
}

// Restore runs `criu restore --stream --restore-detached` fed by an
// in-process serve of src and returns the restored root PID. If serving
// failed while CRIU nevertheless finished, the restored tree is killed:
// it cannot be trusted. TIME_WAIT sockets that would refuse CRIU's bind of
// the image's listeners are cleared first (ClearTimeWait), and the PIDs
// the image restores waited for (waitFreePIDs).
func Restore(ctx context.Context, o CRIURestoreOptions, src source.Source) (rep RestoreReport, err error) {
	carried := append(CarriedIn(src), o.Carry...)
	if o.Launcher != nil {
		for _, p := range o.Launcher.Carried() {
			carried = append(carried, filepath.Base(p))
		}
	}
	pids := waitFreePIDs(ClearTimeWait(src, o.Hooks.log), o.FreePIDs, o.Hooks.log)
	src = pids
	defer func() { rep.PIDWait = pids.Waited() }()
	dir, images, cleanup, err := workDirs(o.WorkDir)
	if err != nil {
		return rep, err
	}
	defer func() { err = finishWorkDir(err, dir, o.WorkDir == "", cleanup) }()
	rep.LogPath = filepath.Join(images, "restore.log")
	pidfile := filepath.Join(dir, "restored.pid")
	if err := WriteCarried(ctx, src, images, carried); err != nil {
		return rep, err
	}
	parent := ctx
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	listening := make(chan struct{})
	hooks := o.Hooks
	userListening := hooks.Listening
	hooks.Listening = func() {
		if userListening != nil {
			userListening()
		}
		close(listening)
	}
	var serveErr error
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		rep.ServeResult, serveErr = ServeWith(ctx, images, src, ServeOptions{Hooks: hooks, Producers: o.Producers, MemoryLimit: o.MemoryLimit, SpillDir: o.SpillDir})
	}()
	select {
	case <-listening:
	case <-ctx.Done():
	}
	out, took, criuErr := runRestore(ctx, o, images, pidfile, src, &rep)
	rep.CRIU = took
	if criuErr != nil {
		cancel() // stop serving: CRIU is gone
	}
	wg.Wait()
	if criuErr == nil && errors.Is(serveErr, ErrOutstanding) {
		// CRIU succeeded: leaving the rest of a file was its decision,
		// made just before it closed the socket.
		hooks.log(serveErr.Error())
		serveErr = nil
	}
	switch {
	case criuErr != nil && parent.Err() != nil:
		return rep, interruptedRestore(parent, criuErr)
	case criuErr != nil && errors.Is(serveErr, ErrPIDTaken):
		return rep, serveErr // CRIU failed for it, before it forked
	case serveErr != nil && criuErr == nil:
		// The whole tree: a child of a detached restore would live on
		// without its root.
		if rep.PID > 0 {
			if err := proc.KillTree(rep.PID); err != nil {
				return rep, fmt.Errorf("serving failed: %w; killing the restored tree of %d failed: %v", serveErr, rep.PID, err)
			}
		}
		return rep, fmt.Errorf("serving failed, restored tree of process %d killed: %w", rep.PID, serveErr)
	case criuErr != nil && serveErr != nil && !errors.Is(serveErr, context.Canceled):
		return rep, fmt.Errorf("criu restore: %w; serve: %w", criuErr, serveErr)
	case criuErr != nil:
		return rep, criuFailed{fmt.Errorf("criu restore: %w; %s", criuErr, criuLogTail(rep.LogPath, out))}
	}
	return rep, nil
}

// runRestore runs CRIU's restore from images, here or through
// o.Launcher, and sets rep.PID.
func runRestore(ctx context.Context, o CRIURestoreOptions, images, pidfile string, src source.Source, rep *RestoreReport) (out string, took time.Duration, err error) {
	if o.Launcher != nil {
		l, err := o.Launcher.Restore(ctx, Launch{CRIU: o.CRIU, ImagesDir: images, WorkDir: filepath.Dir(images), Args: o.ExtraArgs, Src: src})
		rep.PID, rep.LogPath = l.PID, l.Log
		return l.Output, l.Took, err
	}
	reach, release, err := ReachableDir(images)
	if err != nil {
		return "", 0, err
	}
	defer release()
	args := []string{"restore", "--stream", "-D", reach, "--restore-detached", "--pidfile", pidfile, "-o", "restore.log", "-v4"}
	out, took, err = runCRIU(ctx, o.CRIU, append(args, o.ExtraArgs...), o.Hooks)
	rep.PID = ReadPID(pidfile)
	return out, took, err
}

// ReadPID is the PID criu restore --pidfile wrote (0: none).
func ReadPID(pidfile string) int {
	b, err := os.ReadFile(pidfile)
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return pid
}

// needsShellJob recognises CRIU's complaints about a process attached to a
// terminal, which --shell-job answers.
func needsShellJob(log string) bool {
	// Every complaint of criu/tty.c is about a terminal --shell-job handles.
	for _, s := range []string{"shell-job", "criu/tty.c", "Don't have tty to inherit session from"} {
		if strings.Contains(log, s) {
			return true
		}
	}
	return false
}

// criuLogTail picks CRIU's error lines, which say why it failed, and
// names the log where CRIU wrote one (finishWorkDir keeps it then; a CRIU
// that failed before it wrote one, on its command line, has only output).
func criuLogTail(logPath, output string) string {
	b, err := os.ReadFile(logPath)
	var errs []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, "Error") && !strings.Contains(l, "RLIMIT_NOFILE") {
			errs = append(errs, strings.TrimSpace(l))
		}
	}
	if len(errs) > 5 {
		errs = errs[len(errs)-5:]
	}
	msg := strings.Join(errs, "; ")
	if msg == "" {
		msg = strings.TrimSpace(output)
	}
	if err == nil {
		msg = fmt.Sprintf("log %s: %s", logPath, msg)
	}
	if needsShellJob(string(b) + output) {
		msg += "; the process has a controlling terminal: pass criu's --shell-job through gpucr-stream as --criu-opts --shell-job (on restore too)"
	}
	return msg
}
