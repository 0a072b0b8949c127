// Command gpucr-stream streams CRIU and GPU checkpoint images: capture from
// `criu dump --stream`, serve to `criu restore --stream`, and keep them as
// streams or archives. This package only parses flags, wires the pieces and
// maps errors to exit codes; the work happens in capture, streamer, sinks.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/streamer"
)

// Exit codes are part of the interface: scripts test them. Documented in
// the README.
const (
	exitOK          = 0
	exitFailure     = 1 // anything not listed below
	exitUsage       = 2 // bad flags or arguments
	exitCorrupt     = 3 // data failed a checksum or structural check
	exitNotFound    = 4 // no such checkpoint or file
	exitVersion     = 5 // written by a newer format version
	exitInterrupted = 130
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return usageError{fmt.Sprintf(format, args...)} }

func exitCode(err error, interrupted bool) int {
	var ue usageError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ue):
		return exitUsage
	case errors.Is(err, manifest.ErrNewerVersion):
		return exitVersion
	case errors.Is(err, manifest.ErrCorrupt):
		return exitCorrupt
	case errors.Is(err, streamer.ErrNotExist):
		return exitNotFound
	case interrupted || errors.Is(err, context.Canceled):
		return exitInterrupted
	}
	return exitFailure
}

func main() {
	// GPUCR_CPUPROFILE=FILE writes a CPU profile, for benchmark analysis.
	if p := os.Getenv("GPUCR_CPUPROFILE"); p != "" {
		if f, err := os.Create(p); err == nil && pprof.StartCPUProfile(f) == nil {
			code := realMain()
			pprof.StopCPUProfile()
			os.Exit(code)
		}
	}
	os.Exit(realMain())
}

func realMain() int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	interrupted := ctx.Err() != nil
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpucr-stream: %v\n", err)
		var ue usageError
		if errors.As(err, &ue) {
			fmt.Fprintln(os.Stderr, "Run 'gpucr-stream --help' for usage.")
		}
	}
	return exitCode(err, interrupted)
}

type command struct {
	name    string
	summary string
	run     func(ctx context.Context, cfg *config, args []string) error
}

func commands() []command {
	return []command{
		{"capture", "take images from `criu dump --stream -D DIR` and write them to --to (default: stdout)", runCapture},
		{"serve", "serve images from --from (default: stdin) to `criu restore --stream -D DIR`", runServe},
		{"extract", "write the image files from --from (default: stdin) into --images-dir", runExtract},
		{"checkpoint", "checkpoint process --pid with criu into --to; the checkpoint is committed before CRIU kills it", runCheckpoint},
		{"restore", "restore a checkpoint from --from (or SRC) with criu and print the new PID", runRestore},
		{"run", "run a CUDA program with the fast-path library (LD_PRELOAD): run -- CMD [ARGS...]", func(ctx context.Context, cfg *config, args []string) error { return runRun(cfg, args) }},
		{"gpu", "CUDA checkpoint steps of --pid: gpu info|state|lock|checkpoint|restore|unlock|suspend|resume (suspend --to DEST / resume --from SRC: the fast path, the process alive without device memory)", runGPU},
		{"vram", "VRAM producers: vram push|pull --images-dir DIR NAME FILE|- (push into a capture, pull from a serve)", runVRAM},
		{"migrate", "move process --pid to a receiver: checkpoint straight to --to tcp://HOST:PORT, restored there (CUDA processes too: --cuda, --lock-timeout; --gpu-map on the receiver)", runMigrate},
		{"receive", "accept one checkpoint on --listen HOST:PORT and serve it to criu restore (--restore: restore it and print the PID)", runReceive},
		{"token", "print a new shared secret for tcp:// (gpucr-stream token > FILE; pass --token-file FILE on both sides)", runToken},
		{"inspect", "list the files, sizes, codecs and ratios of a checkpoint: inspect SRC", runInspect},
		{"verify", "decode a checkpoint and check every checksum and hash: verify SRC", runVerify},
		{"ls", "list the complete checkpoints under a location: ls s3://BUCKET/PREFIX or ls DIR", runLs},
		{"rm", "delete one checkpoint, manifest first: rm s3://BUCKET/PREFIX/NAME or rm DIR", runRm},
		{"gc", "remove unfinished checkpoints and uploads older than --older-than: gc LOCATION", runGc},
		{"version", "print the version", func(ctx context.Context, cfg *config, args []string) error {
			fmt.Fprintln(cfg.stdout, "gpucr-stream", version)
			return nil
		}},
	}
}

func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	cfg := newConfig(stdin, stdout, stderr)
	fs := cfg.flagSet()
	// Flags may come before and after the command, as criu-image-streamer
	// users write `--images-dir DIR capture`.
	if err := fs.Parse(args); err != nil {
		return usagef("%v", err)
	}
	rest := fs.Args()
	if cfg.help || len(rest) == 0 {
		printHelp(stdout, fs)
		if cfg.help {
			return nil
		}
		return usagef("no command given")
	}
	name := rest[0]
	if name == "run" {
		// Everything after `run` belongs to the program.
		return runRun(cfg, rest[1:])
	}
	if err := fs.Parse(rest[1:]); err != nil {
		return usagef("%v", err)
	}
	// Flags may also come between and after the command's arguments
	// (`gpu state --pid N`, `inspect SRC --json`).
	var pos []string
	for more := fs.Args(); len(more) > 0; more = fs.Args() {
		pos = append(pos, more[0])
		if err := fs.Parse(more[1:]); err != nil {
			return usagef("%v", err)
		}
	}
	if cfg.help {
		printHelp(stdout, fs)
		return nil
	}
	for _, c := range commands() {
		if c.name == name {
			if err := cfg.finish(); err != nil {
				return err
			}
			return c.run(ctx, cfg, pos)
		}
	}
	return usagef("unknown command %q", name)
}
