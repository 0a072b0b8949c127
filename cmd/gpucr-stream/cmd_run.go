package main

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/redact"
)

var runCommand = command{"run", "run a CUDA program with the fast-path library (LD_PRELOAD), so that checkpoint and gpu suspend --to can move its device memory themselves", "-- CMD [ARGS...]",
	func() options { return runOptions{} }}

type runOptions struct{ noFlags }

// run execs the program with libgpucr-preload; everything after `--`
// is the program's. gpucr-stream's and S3's secrets stay out of its
// environment: whatever the process holds lands in its checkpoints.
func (runOptions) run(_ context.Context, c *cli, args []string) error {
	if len(args) == 0 {
		return usagef("run needs a program: gpucr-stream run -- CMD [ARGS...]")
	}
	if _, dropped := redact.Environ(os.Environ()); len(dropped) > 0 {
		for _, name := range dropped {
			os.Unsetenv(name)
		}
		c.logLine(fmt.Sprintf("run: not passing %s to the program (they would land in its checkpoints)", strings.Join(dropped, ", ")))
	}
	return preloadctl.Exec(args)
}
