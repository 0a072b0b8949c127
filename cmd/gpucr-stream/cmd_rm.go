package main

import (
	"context"
	"fmt"

	"github.com/gpucr/gpucr-stream/catalog"
)

var rmCommand = command{"rm", "delete one checkpoint, manifest first: rm s3://BUCKET/PREFIX/NAME or rm DIR", "LOCATION",
	func() options { return &rmOptions{} }}

type rmOptions struct {
	loc    locationFlags
	dryRun bool
}

func (o *rmOptions) register(f *flags) {
	f.show("json")
	o.loc.register(f.narrow(s3ConnNames))
	f.boolean(&o.dryRun, "dry-run")
}

// run deletes one checkpoint, manifest first (catalog.Remove).
func (o *rmOptions) run(ctx context.Context, c *cli, args []string) error {
	st, loc, closeStore, err := storeAt(ctx, c, &o.loc, "rm", args)
	if err != nil {
		return err
	}
	defer closeStore()
	res, err := catalog.Remove(ctx, st, loc.String(), o.dryRun)
	if err != nil {
		return fmt.Errorf("rm: %w", err)
	}
	if c.json {
		return c.printJSON(res)
	}
	fmt.Fprintf(c.stdout, "%s %s (%d objects, %s)\n", verb(o.dryRun), res.Location, res.Objects, humanBytes(res.Bytes))
	if res.Unread != "" {
		fmt.Fprintf(c.stderr, "rm: the manifest could not be read (%s): its segments are left for `gpucr-stream gc`\n", res.Unread)
	}
	return nil
}
