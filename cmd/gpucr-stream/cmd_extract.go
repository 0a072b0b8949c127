package main

import (
	"context"

	"github.com/gpucr/gpucr-stream/checkpoint"
)

var extractCommand = command{"extract", "write the image files from --from (default: stdin) into --images-dir", "",
	func() options { return &extractOptions{} }}

type extractOptions struct{ dropIn }

func (o *extractOptions) register(f *flags) {
	o.dropIn.register(f.narrow(imagesNames, keyNames, decodeNames, s3ReadNames, tcpListenNames, []string{"from"}))
	f.describe("images-dir", "the directory to write the image files into (created if missing), as `criu restore -D DIR` reads them")
	f.describe("shard-fds", "comma-separated descriptors to gather the stream from, instead of stdin")
	f.describe("ext-file-fds", "the stream's extra files to write out, NAME:FD,... (capture --ext-file-fds carried them)")
	f.describe("memory-limit", "memory for chunks in flight (auto: 1GiB; reading a stream: half the available memory, at least 1GiB)")
	f.describe("spill-dir", "where a stream's chunks that do not fit in --memory-limit while they are decoded go (default: $TMPDIR)")
}

func (o *extractOptions) run(ctx context.Context, c *cli, args []string) error {
	return o.dropIn.run(ctx, c, args, "extract", "--from SRC", checkpoint.Extract)
}
