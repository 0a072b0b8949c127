package main

// Flags: every flag is defined once, in flagTable (its default and what it
// does, in the terms of the full help). A command's options are a struct of
// its own (cmd_VERB.go) whose register binds its fields to the flags it
// offers, through the shared groups (groups.go) and by name; it may
// describe a flag in its own terms. Every flag's default is read from its
// environment variable (knobs.FlagVar), where the command offers it.

import (
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"

	"github.com/gpucr/gpucr-stream/knobs"
)

type flagKind int

const (
	strFlag flagKind = iota
	numFlag
	boolFlag
)

// flagDef is one flag as the full help shows it.
type flagDef struct {
	name  string
	kind  flagKind
	def   string
	usage string
}

// shortFlags are criu-image-streamer's short options, by the long flag
// each stands for; a command that offers the long flag takes the short.
var shortFlags = map[string]string{"D": "images-dir", "s": "shard-fds", "e": "ext-file-fds", "p": "progress-fd", "V": "version", "h": "help"}

// longName is the flag a name given on the command line stands for.
func longName(name string) string {
	if long, ok := shortFlags[name]; ok {
		return long
	}
	return name
}

// shortOf is the short option of flag long, "" where it has none.
func shortOf(long string) string {
	for s, l := range shortFlags {
		if l == long {
			return s
		}
	}
	return ""
}

// lookupDef is flag name's definition.
func lookupDef(name string) (flagDef, bool) {
	i := slices.IndexFunc(flagTable, func(d flagDef) bool { return d.name == name })
	if i < 0 {
		return flagDef{}, false
	}
	return flagTable[i], true
}

// flags binds one command's options to its flag set. A view made by narrow
// binds the flags it names and gives the others their defaults alone, so
// that a group offers a command part of its flags.
type flags struct {
	*flagState
	only map[string]bool // nil: every flag
}

type flagState struct {
	fs *flag.FlagSet
	// quiet flags are taken but not listed (help, completion).
	quiet map[string]bool
	// usage holds the command's own descriptions of its flags.
	usage map[string]string
	// checks run once the command line is parsed, in order.
	checks []func() error
	// given are the flags on the command line.
	given map[string]bool
}

func newFlags() *flags {
	fs := flag.NewFlagSet("gpucr-stream", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return &flags{flagState: &flagState{fs: fs, quiet: map[string]bool{}, usage: map[string]string{}, given: map[string]bool{}}}
}

// narrow is a view of f that binds the flags of names only.
func (f *flags) narrow(names ...[]string) *flags {
	only := map[string]bool{}
	for _, l := range names {
		for _, n := range l {
			if f.only == nil || f.only[n] {
				only[n] = true
			}
		}
	}
	return &flags{flagState: f.flagState, only: only}
}

// def is name's default, from its environment variable where the flag is
// bound; bound says whether it is.
func (f *flags) def(name string, kind flagKind) (d flagDef, bound bool) {
	d, ok := lookupDef(name)
	if !ok || d.kind != kind {
		panic(fmt.Sprintf("flag --%s: not in flagTable as this kind", name)) // a programming error, caught by the tests
	}
	if f.only != nil && !f.only[name] {
		return d, false
	}
	if v, ok := knobs.FlagValue(name); ok {
		d.def = v
	}
	return d, true
}

// str binds p to flag name, or only gives it its default (see narrow).
func (f *flags) str(p *string, name string) {
	d, bound := f.def(name, strFlag)
	*p = d.def
	if bound {
		f.fs.StringVar(p, name, d.def, d.usage)
		f.short(name)
	}
}

// num is str for a whole number; a variable that is not one is ignored.
func (f *flags) num(p *int, name string) {
	d, bound := f.def(name, numFlag)
	n, err := strconv.Atoi(d.def)
	if err != nil {
		def, _ := lookupDef(name)
		n, _ = strconv.Atoi(def.def)
	}
	*p = n
	if bound {
		f.fs.IntVar(p, name, n, d.usage)
		f.short(name)
	}
}

// boolean is str for a flag without a value; a variable that is not true
// or false reads as false.
func (f *flags) boolean(p *bool, name string) {
	d, bound := f.def(name, boolFlag)
	*p, _ = strconv.ParseBool(d.def)
	if bound {
		f.fs.BoolVar(p, name, *p, d.usage)
		f.short(name)
	}
}

func (f *flags) short(long string) {
	if s := shortOf(long); s != "" {
		fl := f.fs.Lookup(long)
		f.fs.Var(fl.Value, s, "short for --"+long)
	}
}

// describe gives flag name this command's description.
func (f *flags) describe(name, usage string) { f.usage[name] = usage }

// check runs fn once the command line is parsed.
func (f *flags) check(fn func() error) { f.checks = append(f.checks, fn) }

// bad reports a bad value of flag name, naming where it came from: the
// command line, or its environment variable.
func (f *flags) bad(name, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...)
	if f.given[name] {
		return usagef("--%s %s", name, msg)
	}
	return usagef("$%s (--%s) %s", knobs.FlagVar(name), name, msg)
}

// bound says whether flag name is bound (offered, quiet or not).
func (f *flags) bound(name string) bool { return f.fs.Lookup(name) != nil }

// show lists report flags (quiet until then) in the command's help.
func (f *flags) show(names ...string) {
	for _, n := range names {
		delete(f.quiet, n)
	}
}

// listed are the flags the command lists, sorted: its own and the global ones.
func (f *flags) listed() []string {
	var names []string
	f.fs.VisitAll(func(fl *flag.Flag) {
		if _, short := shortFlags[fl.Name]; !short && !f.quiet[fl.Name] {
			names = append(names, fl.Name)
		}
	})
	return names
}
