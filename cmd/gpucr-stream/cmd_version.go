package main

import (
	"context"
	"fmt"
)

var versionCommand = command{"version", "print the version", "", nil, func(ctx context.Context, cfg *config, args []string) error {
	fmt.Fprintln(cfg.stdout, "gpucr-stream", version)
	return nil
}}
