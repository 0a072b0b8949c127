package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"
)

// command is one verb of gpucr-stream: cmd_VERB.go defines its options.
type command struct {
	name    string
	summary string
	// args names the positional arguments for the usage line.
	args string
	// options makes the command's options, empty.
	options func() options
}

// options are a command's: register binds them to the flags the command
// offers, run runs it once they are parsed and checked.
type options interface {
	register(f *flags)
	run(ctx context.Context, c *cli, args []string) error
}

// noFlags are the options of a command that has no flags of its own.
type noFlags struct{}

func (noFlags) register(*flags) {}

func commands() []command {
	return []command{
		captureCommand, serveCommand, extractCommand, checkpointCommand, restoreCommand, runCommand, gpuCommand,
		vramCommand, migrateCommand, receiveCommand, tokenCommand, keygenCommand, inspectCommand, verifyCommand, lsCommand,
		cpCommand, rmCommand, gcCommand, checkCommand, envCommand, versionCommand, completionCommand, swrkCommand,
	}
}

func lookupCommand(name string) (command, bool) {
	for _, c := range commands() {
		if c.name == name {
			return c, true
		}
	}
	return command{}, false
}

// bind makes the flag set of c: its options' flags, the report flags
// (quiet where it does not list them) and the global ones, --help and
// --version (run reads them from every flag's set).
func (c command) bind(out *cli) (options, *flags) {
	f := newFlags()
	for _, name := range []string{"help", "version"} {
		d, _ := lookupDef(name)
		f.fs.Bool(name, false, d.usage)
		f.short(name)
	}
	out.register(f)
	o := c.options()
	o.register(f)
	return o, f
}

// allFlags is every flag of every command, to find the command behind
// flags that come before it; its values are thrown away and no
// environment variable is read.
func allFlags() *flag.FlagSet {
	fs := flag.NewFlagSet("gpucr-stream", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	for _, d := range flagTable {
		switch d.kind {
		case boolFlag:
			fs.Bool(d.name, false, d.usage)
		case numFlag:
			fs.Int(d.name, 0, d.usage)
		default:
			fs.String(d.name, "", d.usage)
		}
	}
	for short, long := range shortFlags {
		fs.Var(fs.Lookup(long).Value, short, "")
	}
	return fs
}

// parseArgs parses flags before, between and after the arguments, as
// criu-image-streamer users write `--images-dir DIR capture` and others
// `inspect SRC --json`; after "--" everything is an argument.
func parseArgs(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos, verbatim []string
	if i := slices.Index(args, "--"); i >= 0 {
		args, verbatim = args[:i], args[i+1:]
	}
	for rest := args; ; {
		if err := fs.Parse(rest); err != nil {
			return nil, usagef("%v", flagError(fs, err))
		}
		if fs.NArg() == 0 {
			break
		}
		pos = append(pos, fs.Arg(0))
		rest = fs.Args()[1:]
	}
	return append(pos, verbatim...), nil
}

func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	// First every flag, to find the command and refuse what no command
	// takes; then the command's own, from its environment variables too.
	all := allFlags()
	pos, err := parseArgs(all, args)
	if err != nil {
		if cmd := commandOf(args); cmd != "none" {
			err = commandError{cmd, err}
		}
		return err
	}
	out := &cli{stdin: stdin, stdout: stdout, stderr: stderr}
	if boolValue(all, "version") {
		// How tools check that criu-image-streamer is installed.
		return versionOptions{}.run(ctx, out, nil)
	}
	if len(pos) == 0 {
		printHelp(stdout)
		if boolValue(all, "help") {
			return nil
		}
		return usagef("no command given")
	}
	c, ok := lookupCommand(pos[0])
	if !ok {
		return usagef("unknown command %q", pos[0])
	}
	o, f := c.bind(out)
	if boolValue(all, "help") {
		printCommandHelp(stdout, c, f)
		return nil
	}
	err = strays(all, f, c.name)
	if err == nil {
		err = execute(ctx, o, f, out, args)
	}
	if isUsage(err) {
		err = commandError{c.name, err}
	}
	return err
}

// execute parses the command line into the command's options, checks
// them and runs the command.
func execute(ctx context.Context, o options, f *flags, out *cli, args []string) error {
	pos, err := parseArgs(f.fs, args)
	if err != nil {
		return err
	}
	f.fs.Visit(func(fl *flag.Flag) { f.given[longName(fl.Name)] = true })
	for _, check := range f.checks {
		if err := check(); err != nil {
			return err
		}
	}
	err = o.run(ctx, out, pos[1:])
	if err != nil && out.json {
		printStuck(out.stdout, err)
	}
	return err
}

// boolValue is the value of a flag of fs without a value.
func boolValue(fs *flag.FlagSet, name string) bool {
	b, _ := fs.Lookup(name).Value.(flag.Getter).Get().(bool)
	return b
}

// strays refuses the flags of the command line (parsed into all) that
// the command does not take but another does: `ls DIR --pid 42` must not
// list DIR as if nothing was said.
func strays(all *flag.FlagSet, f *flags, cmd string) error {
	var stray []string
	all.Visit(func(fl *flag.Flag) {
		if !f.bound(fl.Name) {
			stray = append(stray, "--"+longName(fl.Name))
		}
	})
	if len(stray) > 0 {
		return usagef("%s does not take %s", cmd, strings.Join(stray, ", "))
	}
	return nil
}

// commandError names the command whose help a usage error points to.
type commandError struct {
	cmd string
	err error
}

func (e commandError) Error() string { return e.err.Error() }
func (e commandError) Unwrap() error { return e.err }

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

// plural is n things: "1 argument", "2 arguments".
func plural(n int, thing string) string {
	if n == 1 {
		return "1 " + thing
	}
	return fmt.Sprintf("%d %ss", n, thing)
}
