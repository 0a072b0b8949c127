package main

import (
	"context"
	"fmt"
	"sort"
	"strings"
)

var completionCommand = command{"completion", "print a shell completion script: completion bash (e.g. gpucr-stream completion bash > /etc/bash_completion.d/gpucr-stream)", "bash",
	func() options { return completionOptions{} }}

type completionOptions struct{ noFlags }

func (completionOptions) run(ctx context.Context, c *cli, args []string) error {
	if len(args) != 1 || args[0] != "bash" {
		return usagef("completion takes one argument: bash")
	}
	fmt.Fprint(c.stdout, bashCompletion())
	return nil
}

// bashCompletion completes commands, each command's own flags, and file
// names for everything else; it is generated from the command table, so it
// cannot fall behind it.
func bashCompletion() string {
	// Flags that take no value: any other one consumes the next word.
	var bools []string
	for _, d := range flagTable {
		if d.kind == boolFlag {
			bools = append(bools, "--"+d.name)
			if s := shortOf(d.name); s != "" {
				bools = append(bools, "-"+s)
			}
		}
	}
	sort.Strings(bools)
	var names []string
	var cases strings.Builder
	for _, c := range commands() {
		names = append(names, c.name)
		var flags []string
		_, f := c.bind(&cli{})
		for _, n := range f.listed() {
			flags = append(flags, "--"+n)
		}
		fmt.Fprintf(&cases, "\t%s) flags=%q ;;\n", c.name, strings.Join(flags, " "))
	}
	return fmt.Sprintf(`# bash completion for gpucr-stream (gpucr-stream completion bash)
_gpucr_stream() {
	local cur=${COMP_WORDS[COMP_CWORD]} cmd="" flags="--help --version" i w
	local bools=" %s "
	for ((i = 1; i < COMP_CWORD; i++)); do
		w=${COMP_WORDS[i]}
		case $w in
		*=*) ;;
		-*) [[ $bools == *" $w "* ]] || ((i++)) ;;
		*) cmd=$w; break ;;
		esac
	done
	case $cmd in
%s	esac
	if [[ $cur == -* ]]; then
		COMPREPLY=($(compgen -W "$flags" -- "$cur"))
	elif [[ -z $cmd ]]; then
		COMPREPLY=($(compgen -W %q -- "$cur"))
	else
		COMPREPLY=($(compgen -f -- "$cur"))
	fi
}
complete -o filenames -F _gpucr_stream gpucr-stream
`, strings.Join(bools, " "), cases.String(), strings.Join(names, " "))
}
