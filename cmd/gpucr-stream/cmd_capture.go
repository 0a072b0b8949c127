package main

import (
	"context"

	"github.com/gpucr/gpucr-stream/checkpoint"
)

var captureCommand = command{"capture", "take images from `criu dump --stream -D DIR` and write them to --to (default: stdout)", "",
	[]string{"@key", "@images", "@encode", "@s3", "@tcp", "@report", "to", "pages-last", "producers", "connect-timeout", "create-bucket", "carry"}, runCapture}

func runCapture(ctx context.Context, cfg *config, args []string) error {
	return runStream(ctx, cfg, args, "capture", "--to DEST", checkpoint.Capture)
}
