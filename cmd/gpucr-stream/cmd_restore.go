package main

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/gpucr/gpucr-stream/checkpoint"
)

var restoreCommand = command{"restore", "restore a checkpoint from --from (or SRC) with criu and print the new PID", "[SRC]",
	[]string{"@key", "@decode", "@s3read", "@tcpin", "@criu", "@container", "@report", "from", "cuda", "gpu-map", "stage-memory", "producers"}, runRestore}

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
	criu := cfg.criuOptions()
	if err := cfg.restoreAs(ctx, &criu); err != nil {
		return err
	}
	res, err := checkpoint.Restore(ctx, checkpoint.RestoreOptions{Src: src, Open: cfg.locationConfig(), CRIU: criu,
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
