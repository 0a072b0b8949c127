package criusock

// Lazy restore (issue 23). A restore from a stream hands CRIU every page,
// which it reads into freshly faulted memory at about 1.2 GB/s before the
// process may run: for a receiver that already holds a migrated image, most
// of the downtime. With lazy pages CRIU restores the tree without its
// private anonymous memory, registered with userfaultfd, and `criu
// lazy-pages` hands each page in when the process first touches it, and
// all the others in the background: the process runs once its small state
// is back. CRIU's page server, which would hand the pages in straight from
// the source host, fails on these kernels (docs/MIGRATION.md, "Post-copy
// over the network"), so the daemon reads them from a local copy: every image is
// written into a directory first (a tmpfs of its own where it can), and
// kept until the daemon has handed in the last page. Until then the
// directory is the process's memory: if the daemon fails, the restored
// tree is killed (it would fault on memory that never comes) and the
// caller still has the image it restored from.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/scratch"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/testhook"
)

// LazyRestore is a tree restored with lazy pages, whose memory the daemon
// is still handing in.
type LazyRestore struct {
	PID int
	// Extract is the writing of the images into the directory; CRIU the
	// restore without the private memory.
	Extract, CRIU time.Duration
	Files         int
	Bytes         int64
	LogPath       string

	images *scratch.Dir
	// dir is CRIU's work dir (workDir its img/, where the logs and the
	// daemon's socket go); temporary: made here, removed by cleanup.
	dir, workDir string
	temporary    bool
	cleanup      func()
	daemon       *exec.Cmd
	daemonDone   chan struct{}
	daemonErr    error
}

// lazySocket is where `criu lazy-pages` listens, in CRIU's work dir.
const lazySocket = "lazy-pages.socket"

// CheckLazyPages says whether criu can restore with lazy pages here (the
// kernel's userfaultfd, with the events a tree that forks needs): a
// receiver asks before a sender stops its process for it.
func CheckLazyPages(ctx context.Context, criu string) error {
	out, _, err := runCRIU(ctx, criu, []string{"check", "--feature", "uffd-noncoop"}, Hooks{})
	if err != nil {
		return fmt.Errorf("lazy pages: criu check --feature uffd-noncoop: %w: %s", err, strings.TrimSpace(out))
	}
	return nil
}

// RestoreLazy writes every image of src into a scratch directory, starts
// `criu lazy-pages` on it and runs `criu restore --lazy-pages`. It returns
// once the tree is restored and runs; Wait then waits for the daemon's last
// page. On failure nothing restored is left running.
func RestoreLazy(ctx context.Context, o CRIURestoreOptions, src source.Source) (l *LazyRestore, err error) {
	src = waitFreePIDs(ClearTimeWait(src, o.Hooks.log), o.FreePIDs, o.Hooks.log)
	all, err := src.Files(ctx)
	if err != nil {
		return nil, fmt.Errorf("lazy restore: %w", err)
	}
	// CRIU's images only: a producer's files (the fast path's VRAM files)
	// are read by their producer, from src.
	var files []manifest.File
	var need int64
	for _, f := range all {
		if !f.External {
			files = append(files, f)
			need += f.Size
		}
	}
	dir, work, cleanup, err := workDirs(o.WorkDir)
	if err != nil {
		return nil, err
	}
	l = &LazyRestore{dir: dir, workDir: work, temporary: o.WorkDir == "", cleanup: cleanup, LogPath: filepath.Join(work, "restore.log")}
	defer func() {
		if err != nil {
			l.stop()
			err = finishWorkDir(err, dir, o.WorkDir == "", cleanup)
		}
	}()
	if l.images, err = scratch.New(scratch.DefaultRoot, "", "gpucr-lazy-", need); err != nil {
		return l, fmt.Errorf("lazy restore: %w", err)
	}
	if l.images.Why != "" {
		o.Hooks.log(fmt.Sprintf("lazy restore: the images go into %s, not a tmpfs of their own: %s", l.images.Path, l.images.Why))
	}
	start := time.Now()
	if l.Files, l.Bytes, err = writeFiles(ctx, src, l.images.Path, files); err != nil {
		return l, fmt.Errorf("lazy restore: %w", err)
	}
	l.Extract = time.Since(start)
	if err = l.startDaemon(ctx, o.CRIU); err != nil {
		return l, err
	}
	pidfile := filepath.Join(dir, "restored.pid")
	args := []string{"restore", "-D", l.images.Path, "-W", work, "--lazy-pages", "--restore-detached", "--pidfile", pidfile,
		"-o", "restore.log", "-v4"}
	out, took, criuErr := runCRIU(ctx, o.CRIU, append(args, o.ExtraArgs...), o.Hooks)
	l.CRIU = took
	l.PID = ReadPID(pidfile)
	if criuErr != nil {
		return l, criuFailed{fmt.Errorf("criu restore --lazy-pages: %w; %s", criuErr, criuLogTail(l.LogPath, out))}
	}
	if testhook.Fault("lazy-pages") != nil {
		// Tests: a daemon that dies before the last page.
		l.daemon.Process.Kill()
	}
	return l, nil
}

// startDaemon starts `criu lazy-pages` on the images and waits until it
// listens.
func (l *LazyRestore) startDaemon(ctx context.Context, criu string) error {
	l.daemon = exec.CommandContext(ctx, criu, "lazy-pages", "-D", l.images.Path, "-W", l.workDir, "-o", "lazy-pages.log", "-v2")
	l.daemonDone = make(chan struct{})
	if err := l.daemon.Start(); err != nil {
		close(l.daemonDone)
		return fmt.Errorf("lazy restore: start criu lazy-pages: %w", err)
	}
	go func() {
		defer close(l.daemonDone)
		l.daemonErr = l.daemon.Wait()
	}()
	sock := filepath.Join(l.workDir, lazySocket)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		if _, err := os.Stat(sock); err == nil {
			return nil
		}
		select {
		case <-l.daemonDone:
			return criuFailed{fmt.Errorf("lazy restore: criu lazy-pages exited before it listened: %v; %s", l.daemonErr,
				criuLogTail(filepath.Join(l.workDir, "lazy-pages.log"), ""))}
		case <-ctx.Done():
			return context.Cause(ctx)
		default:
		}
		if time.Now().After(deadline) {
			return errors.New("lazy restore: criu lazy-pages did not listen within 10s")
		}
	}
}

// Wait waits until the daemon has handed in the last page, then removes
// the images. If the daemon failed, the restored tree is killed (it would
// wait on memory that never comes) and the error says so.
func (l *LazyRestore) Wait(ctx context.Context) error {
	select {
	case <-l.daemonDone:
	case <-ctx.Done():
	}
	err := l.daemonErr
	if ctx.Err() != nil {
		err = context.Cause(ctx)
	}
	if err != nil {
		msg := fmt.Sprintf("criu lazy-pages failed before the last page of process %d was in: %v; %s", l.PID, err,
			criuLogTail(filepath.Join(l.workDir, "lazy-pages.log"), ""))
		if kerr := proc.KillTree(l.PID); kerr != nil {
			msg += fmt.Sprintf("; killing the restored tree failed (%v): kill it", kerr)
		} else {
			msg += "; the restored tree was killed"
		}
		l.stop()
		return finishWorkDir(criuFailed{errors.New(msg)}, l.dir, l.temporary, l.cleanup)
	}
	l.stop()
	l.cleanup()
	return nil
}

// Abort ends a lazy restore whose tree the caller killed: the daemon
// goes, and the images and the work dir with it.
func (l *LazyRestore) Abort() {
	l.stop()
	l.cleanup()
}

// stop ends the daemon, if it runs, and removes the images.
func (l *LazyRestore) stop() {
	if l.daemon != nil && l.daemon.Process != nil {
		select {
		case <-l.daemonDone:
		default:
			l.daemon.Process.Kill()
			<-l.daemonDone
		}
	}
	if l.images != nil {
		l.images.Remove()
		l.images = nil
	}
}
