package main

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/gpucr/gpucr-stream/catalog"
)

var rmCommand = command{"rm", "delete one checkpoint, manifest first: rm s3://BUCKET/PREFIX/NAME or rm DIR", "LOCATION",
	[]string{"@s3conn", "dry-run", "json"}, runRm}

// runRm deletes one checkpoint, manifest first (catalog.Remove).
func runRm(ctx context.Context, cfg *config, args []string) error {
	st, loc, closeStore, err := storeAt(ctx, cfg, "rm", args)
	if err != nil {
		return err
	}
	defer closeStore()
	res, err := catalog.Remove(ctx, st, loc.String(), cfg.dryRun)
	if err != nil {
		return fmt.Errorf("rm: %w", err)
	}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(res)
	}
	fmt.Fprintf(cfg.stdout, "%s %s (%d objects, %s)\n", verb(cfg.dryRun), res.Location, res.Objects, humanBytes(res.Bytes))
	if res.Unread != "" {
		fmt.Fprintf(cfg.stderr, "rm: the manifest could not be read (%s): its segments are left for `gpucr-stream gc`\n", res.Unread)
	}
	return nil
}
