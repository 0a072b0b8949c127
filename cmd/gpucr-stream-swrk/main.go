// Command gpucr-stream-swrk is `gpucr-stream swrk` alone (package swrk):
// the program a container runtime runs as its CRIU (`runc --criu`), twice
// for each checkpoint (runc's version check, then the dump). It links
// nothing else of gpucr-stream's (the CUDA driver's loader, which makes
// gpucr-stream a dynamically linked program, S3, the commands), so it
// starts in about half gpucr-stream's time, on a path where runc's own
// checkpoint is the yardstick. `checkpoint --container` and `restore
// --container` point the runtime at it where it lies beside gpucr-stream
// (container.Options.Self).
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/gpucr/gpucr-stream/swrk"
)

func main() {
	args := os.Args[1:]
	if len(args) == 0 || args[0] != "swrk" {
		// Any other command line is the real criu's (`criu check`,
		// `criu --version`), as for gpucr-stream installed as criu.
		fmt.Fprintf(os.Stderr, "gpucr-stream-swrk: %v\n", swrk.ExecCRIU(args))
		os.Exit(1)
	}
	if len(args) != 2 {
		fmt.Fprintf(os.Stderr, "gpucr-stream-swrk: usage: gpucr-stream-swrk swrk FD (the descriptor of CRIU's RPC socket), as `criu swrk FD`\n")
		os.Exit(2)
	}
	fd, err := swrk.ParseFD(args[1])
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpucr-stream-swrk: swrk: %v\n", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err = swrk.Serve(ctx, fd)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpucr-stream-swrk: %v\n", err)
		os.Exit(1)
	}
}
