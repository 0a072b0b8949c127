package main

import (
	"context"
	"fmt"
)

var versionCommand = command{"version", "print the version (also --version, -V)", "", nil, runVersion}

func runVersion(ctx context.Context, cfg *config, args []string) error {
	fmt.Fprintln(cfg.stdout, "gpucr-stream", version)
	return nil
}
