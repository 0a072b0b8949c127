package main

import (
	"fmt"
	"io"
	"regexp"
	"sort"

	"github.com/gpucr/gpucr-stream/knobs"
)

func printHelp(w io.Writer) {
	fmt.Fprintf(w, `gpucr-stream: checkpoint image streamer for CRIU and GPU processes

Usage:
  gpucr-stream [flags] COMMAND [flags] [args]

Commands:
`)
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-10s %s\n", c.name, c.summary)
	}
	fmt.Fprintf(w, "\nFlags (each command takes some of them: gpucr-stream COMMAND --help lists which;\neach is also read from the environment variable shown):\n")
	var lines []flagLine
	for _, d := range flagTable {
		lines = append(lines, flagLine{d.name, d.usage, d.def})
	}
	printFlags(w, lines)
	fmt.Fprintf(w, "\nEnvironment (besides each flag's variable; gpucr-stream env shows their values):\n")
	for _, k := range knobs.All() {
		who := ""
		if k.Library {
			who = "libgpucr-preload: "
		}
		fmt.Fprintf(w, "  %s\n      %s%s\n", k.Name, who, k.Meaning)
	}
	fmt.Fprintf(w, `
Examples:
  gpucr-stream --images-dir /tmp/ckpt capture > ckpt.stream &
  criu dump --stream -D /tmp/ckpt -t PID

  gpucr-stream --images-dir /tmp/ckpt capture | ssh host gpucr-stream --images-dir /tmp/ckpt serve

  gpucr-stream --images-dir /tmp/ckpt capture --to /var/lib/ckpt/job1
  gpucr-stream --images-dir /tmp/ckpt serve --from /var/lib/ckpt/job1

Exit codes: 0 ok, 1 failure, 2 usage, 3 corrupt data, 4 not found, 5 newer format,
6 no room (the host lacks the memory or disk a step needs; nothing changed), 130 interrupted.
`)
}

// printCommandHelp is `gpucr-stream COMMAND --help`: that command's usage
// and the flags it lists, in its terms.
func printCommandHelp(w io.Writer, c command, f *flags) {
	fmt.Fprintf(w, "Usage: gpucr-stream %s [flags]", c.name)
	if c.args != "" {
		fmt.Fprintf(w, " %s", c.args)
	}
	fmt.Fprintf(w, "\n\n%s\n\nFlags (each also read from the environment variable shown):\n", c.summary)
	var lines []flagLine
	for _, n := range f.listed() {
		d, _ := lookupDef(n)
		usage, ok := f.usage[n]
		if !ok {
			// One command's help: "capture/serve: " says nothing there.
			usage = commandPrefix.ReplaceAllString(d.usage, "")
		}
		lines = append(lines, flagLine{n, usage, f.fs.Lookup(n).DefValue})
	}
	printFlags(w, lines)
}

type flagLine struct{ name, usage, def string }

// printFlags lists flags, sorted, with their defaults and environment
// variables.
func printFlags(w io.Writer, lines []flagLine) {
	sort.Slice(lines, func(i, j int) bool { return lines[i].name < lines[j].name })
	label := func(n string) string {
		if s := shortOf(n); s != "" {
			return "-" + s + ", --" + n
		}
		return "    --" + n
	}
	width := 0
	for _, l := range lines {
		width = max(width, len(label(l.name)))
	}
	for _, l := range lines {
		def := ""
		if l.def != "" && l.def != "false" && l.def != "0" {
			def = fmt.Sprintf(" (default %s)", l.def)
		}
		env := ""
		if hasEnv(l.name) {
			env = " $" + knobs.FlagVar(l.name)
		}
		fmt.Fprintf(w, "  %-*s  %s%s%s\n", width, label(l.name), l.usage, def, env)
	}
}

// hasEnv says whether flag name is read from its environment variable
// too: all but --help and --version.
func hasEnv(name string) bool { return name != "help" && name != "version" }

// commandPrefix is the list of commands a flag's description starts with
// in the full help ("checkpoint/restore: ", "rm, gc: ").
var commandPrefix = regexp.MustCompile(`^(?:` + prefixCommand + `(?:/|, ))*` + prefixCommand + `(?: to s3://)?: `)

const prefixCommand = `(?:capture|serve|extract|checkpoint|restore|migrate|receive|cp|rm|gc|check|gpu suspend --to|gpu)`
