package main

import (
	"context"

	"github.com/gpucr/gpucr-stream/vram"
)

var runCommand = command{"run", "run a CUDA program with the fast-path library (LD_PRELOAD), so that checkpoint and gpu suspend --to can move its device memory themselves", "-- CMD [ARGS...]",
	nil, runRun}

// runRun execs the program with libgpucr-preload; everything after `--`
// is the program's.
func runRun(_ context.Context, _ *config, args []string) error {
	if len(args) == 0 {
		return usagef("run needs a program: gpucr-stream run -- CMD [ARGS...]")
	}
	return vram.ExecPreloaded(args)
}
