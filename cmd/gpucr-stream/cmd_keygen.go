package main

import (
	"context"
	"fmt"
	"os"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/location"
)

var keygenCommand = command{"keygen", "print a new encryption key (gpucr-stream keygen > FILE; pass --key-file FILE to write and to read encrypted checkpoints)", "",
	func() options { return keygenOptions{} }}

type keygenOptions struct{ noFlags }

func (keygenOptions) run(ctx context.Context, c *cli, args []string) error {
	if len(args) > 0 {
		return usagef("keygen takes no arguments; write it to a file: gpucr-stream keygen > FILE")
	}
	// A file stdout was redirected to holds the key: owner only.
	if f, ok := c.stdout.(*os.File); ok {
		if err := location.PrivateOutput(f); err != nil {
			return err
		}
	}
	fmt.Fprintln(c.stdout, crypt.GenerateKey())
	return nil
}
