package main

import (
	"context"

	"github.com/gpucr/gpucr-stream/swrk"
)

var swrkCommand = command{"swrk", "CRIU's RPC service for container runtimes (runc --criu gpucr-stream runs it): streams a dump or restore whose images dir holds a streamer socket, passes anything else to criu", "FD",
	func() options { return swrkOptions{} }}

type swrkOptions struct{ noFlags }

func (swrkOptions) run(ctx context.Context, c *cli, args []string) error {
	if len(args) != 1 {
		return usagef("swrk takes the descriptor of CRIU's RPC socket, as `criu swrk FD` does")
	}
	fd, err := swrk.ParseFD(args[0])
	if err != nil {
		return usagef("swrk: %v", err)
	}
	return swrk.Serve(ctx, fd)
}
