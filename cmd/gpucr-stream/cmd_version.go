package main

import (
	"context"
	"fmt"
)

var versionCommand = command{"version", "print the version (also --version, -V)", "",
	func() options { return versionOptions{} }}

type versionOptions struct{ noFlags }

func (versionOptions) run(ctx context.Context, c *cli, args []string) error {
	fmt.Fprintln(c.stdout, "gpucr-stream", version)
	return nil
}
