package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/gpucr/gpucr-stream/catalog"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
)

var lsCommand = command{"ls", "list the complete checkpoints under a location: ls s3://BUCKET/PREFIX or ls DIR", "LOCATION",
	func() options { return &lsOptions{} }}

type lsOptions struct{ loc locationFlags }

func (o *lsOptions) register(f *flags) {
	f.show("json")
	o.loc.register(f.narrow(s3ConnNames))
}

// ls, rm and gc manage the checkpoints under a location (s3://BUCKET/PREFIX
// or a local directory); the work is package catalog.

type (
	lsEntry  = catalog.Entry
	gcResult = catalog.GCResult
)

func (o *lsOptions) run(ctx context.Context, c *cli, args []string) error {
	st, loc, closeStore, err := storeAt(ctx, c, &o.loc, "ls", args)
	if err != nil {
		return err
	}
	defer closeStore()
	entries, err := catalog.List(ctx, st, loc.String())
	if err != nil {
		return fmt.Errorf("ls: %w", err)
	}
	if c.json {
		if entries == nil {
			entries = []lsEntry{}
		}
		enc := json.NewEncoder(c.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(entries)
	}
	printLs(c.stdout, c.stderr, loc, entries)
	return nil
}

func printLs(w, errw io.Writer, loc location.Location, entries []lsEntry) {
	if len(entries) == 0 {
		fmt.Fprintf(errw, "no complete checkpoints in %s\n", loc)
		return
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tCREATED\tRAW\tSTORED\tNEW\tRATIO\tHOST\tPID\tCOMMAND")
	for _, e := range entries {
		name := e.Name
		if name == "" {
			name = "."
		}
		if e.Error != "" {
			fmt.Fprintf(tw, "%s\t?\t?\t%s\t?\t?\t?\t?\t?\n", name, humanBytes(e.StoredBytes))
			fmt.Fprintf(errw, "gpucr-stream: ls: %s: %s\n", e.Location, e.Error)
			continue
		}
		pid := "-"
		if e.PID > 0 {
			pid = fmt.Sprint(e.PID)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%.2fx\t%s\t%s\t%s\n", name, formatTime(e.Created),
			humanBytes(e.RawBytes), humanBytes(e.StoredBytes), humanBytes(e.NewBytes), e.Ratio, manifest.PrintableName(e.Host), pid, commandLine(e.Cmdline, 40))
	}
	tw.Flush()
}
