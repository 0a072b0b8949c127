package main

import (
	"context"

	"github.com/gpucr/gpucr-stream/checkpoint"
)

var extractCommand = command{"extract", "write the image files from --from (default: stdin) into --images-dir", "",
	[]string{"@key", "@images", "@decode", "@s3read", "@tcpin", "@report", "from"}, runExtract}

func runExtract(ctx context.Context, cfg *config, args []string) error {
	return runStream(ctx, cfg, args, "extract", "--from SRC", checkpoint.Extract)
}
