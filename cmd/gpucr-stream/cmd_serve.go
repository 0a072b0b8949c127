package main

import (
	"context"

	"github.com/gpucr/gpucr-stream/checkpoint"
)

var serveCommand = command{"serve", "serve images from --from (default: stdin) to `criu restore --stream -D DIR`", "",
	func() options { return &serveOptions{} }}

type serveOptions struct{ dropIn }

func (o *serveOptions) register(f *flags) {
	o.dropIn.register(f.narrow(imagesNames, keyNames, decodeNames, s3ReadNames, tcpListenNames,
		[]string{"from", "producers", "connect-timeout", "tcp-listen-remap", "early", "carry"}))
	f.describe("images-dir", "CRIU's images directory (criu restore --stream -D DIR): serve listens on its socket there (created if missing)")
	f.describe("shard-fds", "comma-separated descriptors to gather the stream from, instead of stdin")
	f.describe("ext-file-fds", "the stream's extra files to write out, NAME:FD,... (capture --ext-file-fds carried them)")
	f.describe("carry", "with --early: carried files (capture --carry) to wait for in a stream and write into the images dir before criu starts, comma-separated; without it every carried file is written back")
	f.describe("producers", "VRAM producers (vram pull) the serve waits for: it does not end before that many have connected and taken their files")
}

func (o *serveOptions) run(ctx context.Context, c *cli, args []string) error {
	return o.dropIn.run(ctx, c, args, "serve", "--from SRC", checkpoint.Serve)
}
