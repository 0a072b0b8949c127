package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/gpuckpt"
	"github.com/gpucr/gpucr-stream/manifest"
)

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

func verb(dryRun bool) string {
	if dryRun {
		return "would remove"
	}
	return "removed"
}

// The results' JSON is printed as the library returns it.
type (
	phase            = checkpoint.Phase
	checkpointResult = checkpoint.Result
	restoreResult    = checkpoint.RestoreResult
)

func printPhases(w io.Writer, what string, ps []phase, total float64) {
	fmt.Fprintf(w, "%s done in %.2fs\n", what, total)
	for _, p := range ps {
		fmt.Fprintf(w, "  %-30s %7.3fs\n", p.Name, p.Secs)
	}
}

// printStuck writes, for --json, where a failed undo left each CUDA
// process and the command that brings it back (gpuckpt.StuckError), so
// that scripts find them in the output they parse; other errors write
// nothing there.
func printStuck(w io.Writer, err error) {
	var st *gpuckpt.StuckError
	if errors.As(err, &st) {
		json.NewEncoder(w).Encode(struct {
			Error string              `json:"error"`
			Procs []gpuckpt.ProcState `json:"gpu_processes"`
		}{err.Error(), st.Procs})
	}
}

// printGPUs names the CUDA processes and GPUs of a checkpoint.
func printGPUs(w io.Writer, pids []int, gpus []manifest.GPU) {
	if len(pids) == 0 {
		return
	}
	fmt.Fprintf(w, "  CUDA processes %v", pids)
	for _, g := range gpus {
		fmt.Fprintf(w, "; %s %s", g.UUID, g.Name)
		if g.Bytes > 0 {
			fmt.Fprintf(w, " (%s of device memory)", humanBytes(g.Bytes))
		}
	}
	fmt.Fprintln(w)
}

// formatTime is how ls and inspect print times: RFC 3339 in UTC, so that
// both say the same, with the zone.
func formatTime(t time.Time) string {
	if t.IsZero() {
		return "?"
	}
	return t.UTC().Format(time.RFC3339)
}

// commandLine joins a process's arguments for display, cut to max
// characters (0: whole); "-" when unknown.
func commandLine(args []string, max int) string {
	// From a manifest: untrusted, so never control characters on a terminal.
	s := manifest.PrintableName(strings.Join(args, " "))
	if s == "" || s == `""` {
		return "-"
	}
	if max > 0 && len(s) > max {
		s = s[:max-3] + "..."
	}
	return s
}
