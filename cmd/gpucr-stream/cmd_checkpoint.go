package main

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/gpucr/gpucr-stream/checkpoint"
)

var checkpointCommand = command{"checkpoint", "checkpoint process --pid with criu into --to; the checkpoint is committed before CRIU kills it", "",
	[]string{"@key", "@encode", "@s3", "@tcp", "@criu", "@container", "@report", "to", "pages-last", "pid", "leave-running", "cuda", "lock-timeout", "producers", "@fastpath", "create-bucket"}, runCheckpoint}

func runCheckpoint(ctx context.Context, cfg *config, args []string) error {
	if len(args) > 0 {
		return usagef("checkpoint: unexpected arguments %q", args)
	}
	cuda, err := cfg.cudaOptions(true)
	if err != nil {
		return err
	}
	dest, err := parseLoc("--to", cfg.to)
	if err != nil {
		return err
	}
	if err := cfg.refuseNoCopy(dest); err != nil {
		return err
	}
	fast, err := cfg.fastPathOptions()
	if err != nil {
		return err
	}
	criu := cfg.criuOptions()
	pid, err := cfg.checkpointTarget(ctx, "checkpoint", &criu)
	if err != nil {
		return err
	}
	res, err := checkpoint.Checkpoint(ctx, checkpoint.Options{PID: pid, Dest: dest, Open: cfg.locationConfig(),
		CRIU: criu, LeaveRunning: cfg.leaveRunning, Producers: cfg.producers, CUDA: cuda, FastPath: fast,
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
