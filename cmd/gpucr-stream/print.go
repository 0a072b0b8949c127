package main

import (
	"fmt"
	"io"

	"github.com/gpucr/gpucr-stream/checkpoint"
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
