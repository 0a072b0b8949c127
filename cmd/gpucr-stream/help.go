package main

import (
	"flag"
	"fmt"
	"io"
	"regexp"
	"sort"
)

func printHelp(w io.Writer, fs *flag.FlagSet) {
	fmt.Fprintf(w, `gpucr-stream: checkpoint image streamer for CRIU and GPU processes

Usage:
  gpucr-stream [flags] COMMAND [flags] [args]

Commands:
`)
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-10s %s\n", c.name, c.summary)
	}
	fmt.Fprintf(w, "\nFlags (each command takes some of them: gpucr-stream COMMAND --help lists which;\neach is also read from the environment variable shown):\n")
	printFlags(w, fs, nil)
	fmt.Fprintf(w, `
Examples:
  gpucr-stream --images-dir /tmp/ckpt capture > ckpt.stream &
  criu dump --stream -D /tmp/ckpt -t PID

  gpucr-stream --images-dir /tmp/ckpt capture | ssh host gpucr-stream --images-dir /tmp/ckpt serve

  gpucr-stream --images-dir /tmp/ckpt capture --to /var/lib/ckpt/job1
  gpucr-stream --images-dir /tmp/ckpt serve --from /var/lib/ckpt/job1

Exit codes: 0 ok, 1 failure, 2 usage, 3 corrupt data, 4 not found, 5 newer format, 130 interrupted.
`)
}

// printCommandHelp is `gpucr-stream COMMAND --help`: that command's usage
// and flags only.
func printCommandHelp(w io.Writer, fs *flag.FlagSet, c command) {
	fmt.Fprintf(w, "Usage: gpucr-stream %s [flags]", c.name)
	if c.args != "" {
		fmt.Fprintf(w, " %s", c.args)
	}
	fmt.Fprintf(w, "\n\n%s\n\nFlags (each also read from the environment variable shown):\n", c.summary)
	printFlags(w, fs, c.flagNames())
}

// printFlags lists the flags of fs that only admits (nil: all), sorted,
// with their defaults and environment variables.
func printFlags(w io.Writer, fs *flag.FlagSet, only map[string]bool) {
	var names []string
	fs.VisitAll(func(f *flag.Flag) {
		if _, short := shortFlags[f.Name]; !short && (only == nil || only[f.Name]) {
			names = append(names, f.Name)
		}
	})
	sort.Strings(names)
	label := func(n string) string {
		for short, long := range shortFlags {
			if long == n {
				return "-" + short + ", --" + n
			}
		}
		return "    --" + n
	}
	width := 0
	for _, n := range names {
		width = max(width, len(label(n)))
	}
	for _, n := range names {
		f := fs.Lookup(n)
		usage := f.Usage
		if only != nil {
			// One command's help: "capture/serve: " says nothing there.
			usage = commandPrefix.ReplaceAllString(usage, "")
		}
		def := ""
		if f.DefValue != "" && f.DefValue != "false" && f.DefValue != "0" {
			def = fmt.Sprintf(" (default %s)", f.DefValue)
		}
		env := " $" + envName(n)
		if n == "help" || n == "version" {
			env = ""
		}
		fmt.Fprintf(w, "  %-*s  %s%s%s\n", width, label(n), usage, def, env)
	}
}

// commandPrefix is the list of commands a flag's description starts with
// in the full help ("checkpoint/restore: ", "rm, gc: ").
var commandPrefix = regexp.MustCompile(`^(?:(?:capture|serve|extract|checkpoint|restore|migrate|receive|cp|rm|gc|check|gpu suspend --to)(?:/|, ))*(?:capture|serve|extract|checkpoint|restore|migrate|receive|cp|rm|gc|check|gpu suspend --to)(?: to s3://)?: `)
