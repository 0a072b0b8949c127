// Command gpucr-stream streams CRIU and GPU checkpoint images: capture from
// `criu dump --stream`, serve to `criu restore --stream`, and keep them as
// streams or archives. This package only parses flags, wires the pieces and
// maps errors to exit codes; the work happens in checkpoint, catalog and
// location, and below them.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime/pprof"
	"slices"
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
// the README.
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

// commandOf is the first argument that names a command: global flags and
// their values may come before it (`--images-dir DIR capture`).
func commandOf(args []string) string {
	for _, a := range args {
		if _, ok := lookupCommand(a); ok {
			return a
		}
	}
	return "none"
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

type command struct {
	name    string
	summary string
	// args names the positional arguments for the usage line.
	args string
	// flags are the command's own flags: names, or "@group" for a group
	// of flagGroups. The global flags apply to every command.
	flags []string
	run   func(ctx context.Context, cfg *config, args []string) error
}

func commands() []command {
	return []command{
		captureCommand, serveCommand, extractCommand, checkpointCommand, restoreCommand, runCommand, gpuCommand,
		vramCommand, migrateCommand, receiveCommand, tokenCommand, keygenCommand, inspectCommand, verifyCommand, lsCommand, cpCommand, rmCommand, gcCommand, checkCommand, versionCommand, completionCommand, swrkCommand,
	}
}

// flagGroups are flags that several commands share.
var flagGroups = map[string][]string{
	"images": {"images-dir", "shard-fds", "ext-file-fds"},
	"encode": {"codec", "chunk-size", "segment-size", "workers", "memory-limit", "chunk-hashes", "dedup"},
	"decode": {"workers", "memory-limit", "spill-dir"},
	"s3":     {"s3-endpoint", "s3-region", "s3-path-style", "s3-part-size", "s3-parallel", "s3-sse", "s3-sse-key-file"},
	// what reading a checkpoint needs, and reading manifests, listing or
	// deleting objects
	"s3read": {"s3-endpoint", "s3-region", "s3-path-style", "s3-parallel", "s3-sse-key-file"},
	"s3conn": {"s3-endpoint", "s3-region", "s3-path-style", "s3-sse-key-file"},
	// progress bars, --progress-fd lines and --json results of long work
	"report": {"json", "no-progress", "progress-fd"},
	"key":    {"key-file"},
	"tcp":    {"streams", "token-file", "tls-cert", "tls-key", "tls-ca", "net-timeout"},
	// a tcp:// receiver: the sender chooses the streams
	"tcpin": {"token-file", "tls-cert", "tls-key", "tls-ca", "net-timeout"},
	"criu":  {"criu", "work-dir", "criu-opts", "carry"},
	// a container, through its runtime (container.go)
	"container": {"container", "runtime", "runtime-root", "bundle"},
	// the GPU fast path of checkpoint, migrate and gpu suspend --to
	"fastpath": {"fast-path", "vram-files", "vram-keep-dir"},
}

// globalFlags apply to every command. quietFlags are taken by every
// command too (drivers of criu-image-streamer pass --progress-fd to all of
// them) but listed only by those that use them.
var (
	globalFlags = []string{"help", "version"}
	quietFlags  = []string{"json", "no-progress", "progress-fd"}
)

// flagNames lists the flags c takes and lists in its help: its own and
// the global ones.
func (c command) flagNames() map[string]bool {
	names := map[string]bool{}
	for _, f := range globalFlags {
		names[f] = true
	}
	for _, f := range c.flags {
		if g, ok := strings.CutPrefix(f, "@"); ok {
			for _, n := range flagGroups[g] {
				names[n] = true
			}
		} else {
			names[f] = true
		}
	}
	return names
}
func lookupCommand(name string) (command, bool) {
	for _, c := range commands() {
		if c.name == name {
			return c, true
		}
	}
	return command{}, false
}
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	cfg := newConfig(stdin, stdout, stderr)
	fs := cfg.flagSet()
	// Flags may come before, between and after the command and its
	// arguments, as criu-image-streamer users write `--images-dir DIR
	// capture` and others `inspect SRC --json`; after "--" everything is
	// an argument.
	var pos, verbatim []string
	if i := slices.Index(args, "--"); i >= 0 {
		args, verbatim = args[:i], args[i+1:]
	}
	for rest := args; ; {
		if err := fs.Parse(rest); err != nil {
			err = usagef("%v", flagError(fs, err))
			if cmd := commandOf(args); cmd != "none" {
				err = commandError{cmd, err}
			}
			return err
		}
		if fs.NArg() == 0 {
			break
		}
		pos = append(pos, fs.Arg(0))
		rest = fs.Args()[1:]
	}
	pos = append(pos, verbatim...)
	if cfg.showVersion {
		// How tools check that criu-image-streamer is installed.
		return runVersion(ctx, cfg, nil)
	}
	if len(pos) == 0 {
		printHelp(stdout, fs)
		if cfg.help {
			return nil
		}
		return usagef("no command given")
	}
	c, ok := lookupCommand(pos[0])
	if !ok {
		return usagef("unknown command %q", pos[0])
	}
	if cfg.help {
		printCommandHelp(stdout, fs, c)
		return nil
	}
	cfg.takes, cfg.onCmdLine = c.flagNames(), map[string]bool{}
	for _, f := range quietFlags {
		cfg.takes[f] = true
	}
	fs.Visit(func(f *flag.Flag) { cfg.onCmdLine[longName(f.Name)] = true })
	err := cfg.finish()
	if err == nil {
		err = checkFlags(fs, c)
	}
	if err == nil && c.flagNames()["key-file"] {
		err = cfg.loadKey()
	}
	if err == nil {
		err = c.run(ctx, cfg, pos[1:])
		if err != nil && cfg.jsonOut {
			printStuck(cfg.stdout, err)
		}
	}
	if isUsage(err) {
		return commandError{c.name, err}
	}
	return err
}

// commandError names the command whose help a usage error points to.
type commandError struct {
	cmd string
	err error
}

func (e commandError) Error() string { return e.err.Error() }
func (e commandError) Unwrap() error { return e.err }

// checkFlags refuses a flag that another command takes: `ls DIR --pid 42`
// must not list DIR as if nothing was said.
func checkFlags(fs *flag.FlagSet, c command) error {
	allowed := c.flagNames()
	for _, f := range quietFlags {
		allowed[f] = true
	}
	var stray []string
	fs.Visit(func(f *flag.Flag) {
		if !allowed[longName(f.Name)] {
			stray = append(stray, "--"+longName(f.Name))
		}
	})
	if len(stray) > 0 {
		return usagef("%s does not take %s", c.name, strings.Join(stray, ", "))
	}
	return nil
}

// flagError says what the flag package's parse errors mean in this
// command's terms: `invalid value "abc" for flag -pid: parse error` is
// `--pid "abc": not a whole number`.
func flagError(fs *flag.FlagSet, err error) error {
	msg := err.Error()
	if m := badValue.FindStringSubmatch(msg); m != nil {
		name, why := longName(m[2]), m[3]
		switch why {
		case "value out of range":
			why = "out of range"
		case "parse error":
			why = "not a whole number"
			if f := fs.Lookup(name); f != nil {
				if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
					why = "not true or false"
				}
			}
		}
		return fmt.Errorf("--%s %q: %s", name, m[1], why)
	}
	if name, ok := strings.CutPrefix(msg, "flag provided but not defined: -"); ok {
		return fmt.Errorf("unknown flag --%s", strings.TrimLeft(name, "-"))
	}
	if name, ok := strings.CutPrefix(msg, "flag needs an argument: -"); ok {
		return fmt.Errorf("--%s needs a value", longName(strings.TrimLeft(name, "-")))
	}
	return err
}

var badValue = regexp.MustCompile(`^invalid (?:boolean )?value "(.*)" for (?:flag )?-+(\S+): (.*)$`)
