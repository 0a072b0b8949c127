package main

import (
	"context"

	"github.com/gpucr/gpucr-stream/checkpoint"
)

var serveCommand = command{"serve", "serve images from --from (default: stdin) to `criu restore --stream -D DIR`", "",
	[]string{"@key", "@images", "@decode", "@s3read", "@tcpin", "@report", "from", "producers", "connect-timeout", "tcp-listen-remap", "early", "carry"}, runServe}

func runServe(ctx context.Context, cfg *config, args []string) error {
	return runStream(ctx, cfg, args, "serve", "--from SRC", checkpoint.Serve)
}
