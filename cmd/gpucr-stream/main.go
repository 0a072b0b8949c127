// Command gpucr-stream streams CRIU and GPU checkpoint images: capture from
// `criu dump --stream`, serve to `criu restore --stream`, and keep them as
// streams or archives. This package only parses flags, wires the pieces and
// maps errors to exit codes; the work happens in checkpoint, catalog and
// location, and below them.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/knobs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/swrk"
)

// Exit codes are part of the interface: scripts test them. Documented in
// docs/EXIT-CODES.md.
const (
	exitOK          = 0
	exitFailure     = 1 // anything not listed below
	exitUsage       = 2 // bad flags or arguments
	exitCorrupt     = 3 // data failed a checksum or structural check
	exitNotFound    = 4 // no such checkpoint or file
	exitVersion     = 5 // written by a newer format version
	exitNoRoom      = 6 // the host has not the memory or disk a step needs; nothing changed
	exitInterrupted = 130
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

// usagef is a usage error (exit 2); libraries below report theirs with
// errdefs.Usagef too.
func usagef(format string, args ...any) error { return errdefs.Usagef(format, args...) }
func isUsage(err error) bool                  { return errors.Is(err, errdefs.ErrUsage) }
func exitCode(err error, interrupted bool) int {
	switch {
	case err == nil:
		return exitOK
	case isUsage(err):
		return exitUsage
	case errors.Is(err, manifest.ErrNewerVersion):
		return exitVersion
	case errors.Is(err, errdefs.ErrCorrupt):
		return exitCorrupt
	case errors.Is(err, errdefs.ErrNotFound):
		return exitNotFound
	case errors.Is(err, errdefs.ErrNoRoom):
		return exitNoRoom
	case interrupted || errors.Is(err, errdefs.ErrInterrupted) || errors.Is(err, context.Canceled):
		return exitInterrupted
	}
	return exitFailure
}
func main() {
	// Installed as criu (for a runtime that runs `criu swrk FD` from PATH,
	// such as crun's libcriu), every other command line is the real criu's.
	if filepath.Base(os.Args[0]) == "criu" && (len(os.Args) < 2 || os.Args[1] != "swrk") {
		fmt.Fprintf(os.Stderr, "gpucr-stream (as criu): %v\n", swrk.ExecCRIU(os.Args[1:]))
		os.Exit(exitFailure)
	}
	// GPUCR_CPUPROFILE=FILE writes a CPU profile, for benchmark analysis;
	// %c in FILE is the command (two of them at once, a sender and a
	// receiver, need two files). Not for run: the profiler's SIGPROF timer
	// would survive its exec and kill the program.
	if p := knobs.CPUProfile.Value(); p != "" {
		if cmd := commandOf(os.Args[1:]); cmd != "run" {
			p = strings.ReplaceAll(p, "%c", cmd)
			if f, err := os.Create(p); err == nil && pprof.StartCPUProfile(f) == nil {
				code := realMain()
				pprof.StopCPUProfile()
				os.Exit(code)
			}
		}
	}
	os.Exit(realMain())
}

func realMain() int {
	ctx, stop := interruptContext()
	// A reader of stdout that goes away (capture | head) must fail the
	// write with EPIPE, not kill the process: the error path resumes the
	// dumped process and removes the work dir. Handled, not ignored, so
	// that CRIU and `run`'s program start with SIGPIPE at its default.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE)
	err := run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	interrupted := ctx.Err() != nil
	stop()
	if err != nil {
		msg := err.Error()
		if interrupted {
			// What stopped at the interrupt says "context canceled".
			msg = strings.ReplaceAll(msg, context.Canceled.Error(), context.Cause(ctx).Error())
		}
		fmt.Fprintf(os.Stderr, "gpucr-stream: %s\n", msg)
		if isUsage(err) {
			help := "gpucr-stream --help"
			var ce commandError
			if errors.As(err, &ce) {
				help = "gpucr-stream " + ce.cmd + " --help"
			}
			fmt.Fprintf(os.Stderr, "Run '%s' for usage.\n", help)
		}
	}
	return exitCode(err, interrupted)
}

// interruptContext is a context that SIGINT or SIGTERM ends, its cause
// errdefs.ErrInterrupted naming the signal. Later signals are taken and
// ignored until stop: the work winds down (CRIU resumes a process it was
// dumping) rather than die halfway.
func interruptContext() (ctx context.Context, stop func()) {
	ctx, cancel := context.WithCancelCause(context.Background())
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	stopped := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		select {
		case s := <-sigs:
			cancel(fmt.Errorf("%w by %s", errdefs.ErrInterrupted, unix.SignalName(s.(syscall.Signal))))
		case <-stopped:
		}
	})
	return ctx, func() {
		signal.Stop(sigs)
		close(stopped)
		wg.Wait()
		cancel(nil)
	}
}
