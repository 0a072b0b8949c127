package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"github.com/gpucr/gpucr-stream/checkpoint"
)

// cli is what every command runs with: its standard streams and how it
// reports.
type cli struct {
	stdin          io.Reader
	stdout, stderr io.Writer
	reportFlags
}

// reportFlags are --json, --no-progress and --progress-fd. Every command
// takes them (drivers of criu-image-streamer pass --progress-fd to all of
// them); a command lists those it uses (flags.show).
type reportFlags struct {
	json       bool
	noProgress bool
	progressFD int
	// progress is --progress-fd opened.
	progress io.Writer
	// dropIn is set for capture, serve and extract, whose progress
	// channel carries criu-image-streamer's lines.
	dropIn bool
}

var reportNames = []string{"json", "no-progress", "progress-fd"}

// register binds the report flags, quiet until a command shows them.
func (c *cli) register(f *flags) {
	f.boolean(&c.json, "json")
	f.boolean(&c.noProgress, "no-progress")
	f.num(&c.progressFD, "progress-fd")
	for _, n := range reportNames {
		f.quiet[n] = true
	}
	f.check(c.openProgress)
}

func (c *cli) openProgress() error {
	switch c.progressFD {
	case 1:
		c.progress = c.stdout
	case 2:
		c.progress = c.stderr
	default:
		if c.progressFD < 0 {
			return usagef("--progress-fd must not be negative")
		}
		c.progress = os.NewFile(uintptr(c.progressFD), fmt.Sprintf("progress fd %d", c.progressFD))
	}
	return nil
}

// logLine writes one diagnostic line to stderr.
func (c *cli) logLine(msg string) {
	fmt.Fprintf(c.stderr, "gpucr-stream: %s\n", msg)
}

// progressLine writes one line to --progress-fd.
func (c *cli) progressLine(s string) {
	fmt.Fprintln(c.progress, s)
}

// statsLine writes criu-image-streamer's statistics line to --progress-fd.
func (c *cli) statsLine(st *checkpoint.Stats) {
	b, _ := json.Marshal(st)
	fmt.Fprintln(c.progress, string(b))
}

// hooks draw the progress bar, write progress lines and log.
func (c *cli) hooks() checkpoint.Hooks {
	return checkpoint.Hooks{
		Progress: func(p checkpoint.Progress) func() { return startProgress(c, p).finish },
		Line:     c.progressLine,
		Stats:    c.statsLine,
		Log:      c.logLine,
	}
}

// printJSON writes v as one line of JSON to stdout.
func (c *cli) printJSON(v any) error { return json.NewEncoder(c.stdout).Encode(v) }
