package main

import (
	"context"
	"fmt"
	"os"

	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/transport/tcp"
)

var tokenCommand = command{"token", "print a new shared secret for tcp:// (gpucr-stream token > FILE; pass --token-file FILE on both sides)", "",
	func() options { return tokenOptions{} }}

type tokenOptions struct{ noFlags }

func (tokenOptions) run(ctx context.Context, c *cli, args []string) error {
	if len(args) > 0 {
		return usagef("token takes no arguments; write it to a file: gpucr-stream token > FILE")
	}
	if f, ok := c.stdout.(*os.File); ok {
		if err := location.PrivateOutput(f); err != nil {
			return err
		}
	}
	fmt.Fprintln(c.stdout, tcp.NewToken())
	return nil
}
