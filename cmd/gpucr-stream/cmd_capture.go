package main

import (
	"context"

	"github.com/gpucr/gpucr-stream/checkpoint"
)

var captureCommand = command{"capture", "take images from `criu dump --stream -D DIR` and write them to --to (default: stdout)", "",
	func() options { return &captureOptions{} }}

type captureOptions struct{ dropIn }

func (o *captureOptions) register(f *flags) {
	o.dropIn.register(f.narrow(imagesNames, keyNames, encodeNames, s3WriteNames, tcpSendNames,
		[]string{"to", "pages-last", "producers", "connect-timeout", "create-bucket", "carry"}))
	f.describe("images-dir", "CRIU's images directory (criu dump --stream -D DIR): capture listens on its socket there (created if missing)")
	f.describe("shard-fds", "comma-separated descriptors to spread the stream over, instead of stdout")
	f.describe("ext-file-fds", "extra files to carry in the stream, NAME:FD,... (serve and extract write them out)")
	f.describe("carry", "files of CRIU's images dir to carry in the checkpoint, comma-separated (a name in the images dir or an absolute path; runc's descriptors.json always goes): restore and serve write them back")
	f.describe("producers", "VRAM producers (vram push) the checkpoint waits for before it is complete")
}

func (o *captureOptions) run(ctx context.Context, c *cli, args []string) error {
	return o.dropIn.run(ctx, c, args, "capture", "--to DEST", checkpoint.Capture)
}
