package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/manifest"
)

// The results' JSON is printed as the library returns it.
type (
	phase            = checkpoint.Phase
	checkpointResult = checkpoint.Result
	restoreResult    = checkpoint.RestoreResult
)

func runCheckpoint(ctx context.Context, cfg *config, args []string) error {
	if len(args) > 0 {
		return usagef("checkpoint: unexpected arguments %q", args)
	}
	if cfg.pid <= 0 {
		return usagef("checkpoint needs --pid PID")
	}
	cuda, err := cfg.cudaOptions(true)
	if err != nil {
		return err
	}
	dest, err := parseLoc("--to", cfg.to)
	if err != nil {
		return err
	}
	res, err := checkpoint.Checkpoint(ctx, checkpoint.Options{PID: cfg.pid, Dest: dest, Open: cfg.locationConfig(),
		CRIU: cfg.criuOptions(), LeaveRunning: cfg.leaveRunning, Producers: cfg.producers, CUDA: cuda,
		Tool: "gpucr-stream " + version, Hooks: cfg.hooks()})
	if err != nil {
		return err
	}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(res)
	}
	if cfg.to == "-" {
		// stdout carries the stream; the summary goes to stderr.
		printPhases(cfg.stderr, "checkpoint", res.Phases, res.TotalSecs)
		return nil
	}
	printPhases(cfg.stdout, "checkpoint", res.Phases, res.TotalSecs)
	fmt.Fprintf(cfg.stdout, "  %d files, %s raw, %s stored (%.2fx) in %s\n", res.Files, humanBytes(res.RawBytes), humanBytes(res.StoredBytes), res.Ratio, res.Destination)
	printGPUs(cfg.stdout, res.CUDAPIDs, res.GPUs)
	return nil
}

func runRestore(ctx context.Context, cfg *config, args []string) error {
	from, err := srcArg(cfg, "restore", args)
	if err != nil {
		return err
	}
	src, err := parseLoc("source", from)
	if err != nil {
		return err
	}
	cuda, err := cfg.cudaOptions(false)
	if err != nil {
		return err
	}
	gpuMap, err := parseGPUMap(cfg.gpuMap)
	if err != nil {
		return err
	}
	res, err := checkpoint.Restore(ctx, checkpoint.RestoreOptions{Src: src, Open: cfg.locationConfig(), CRIU: cfg.criuOptions(),
		Producers: cfg.producers, CUDA: cuda, GPUMap: gpuMap, Hooks: cfg.hooks()})
	if err != nil {
		return err
	}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(res)
	}
	printPhases(cfg.stderr, "restore", res.Phases, res.TotalSecs)
	fmt.Fprintln(cfg.stdout, res.PID)
	return nil
}

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
