package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/gpucr/gpucr-stream/catalog"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/store"
)

// ls, rm and gc manage the checkpoints under a location (s3://BUCKET/PREFIX
// or a local directory); the work is package catalog.

type (
	lsEntry  = catalog.Entry
	gcResult = catalog.GCResult
)

// storeAt opens the store of the one LOCATION argument of ls, rm and gc.
func storeAt(ctx context.Context, cfg *config, cmd string, args []string) (store.Store, location.Location, func(), error) {
	if len(args) != 1 {
		return nil, location.Location{}, nil, usagef("%s takes one LOCATION argument, got %d", cmd, len(args))
	}
	loc, err := location.Parse(args[0])
	if err != nil {
		return nil, loc, nil, usagef("%s: %s: %v", cmd, cmd, err)
	}
	st, closeStore, err := location.OpenStore(ctx, loc, cfg.locationConfig())
	if err != nil {
		return nil, loc, nil, fmt.Errorf("%s: %w", cmd, err)
	}
	return st, loc, closeStore, nil
}

func runLs(ctx context.Context, cfg *config, args []string) error {
	st, loc, closeStore, err := storeAt(ctx, cfg, "ls", args)
	if err != nil {
		return err
	}
	defer closeStore()
	entries, err := catalog.List(ctx, st, loc.String())
	if err != nil {
		return fmt.Errorf("ls: %w", err)
	}
	if cfg.jsonOut {
		if entries == nil {
			entries = []lsEntry{}
		}
		enc := json.NewEncoder(cfg.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(entries)
	}
	printLs(cfg.stdout, cfg.stderr, loc, entries)
	return nil
}

func printLs(w, errw io.Writer, loc location.Location, entries []lsEntry) {
	if len(entries) == 0 {
		fmt.Fprintf(errw, "no complete checkpoints in %s\n", loc)
		return
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tCREATED\tRAW\tSTORED\tRATIO\tHOST")
	for _, e := range entries {
		name := e.Name
		if name == "" {
			name = "."
		}
		if e.Error != "" {
			fmt.Fprintf(tw, "%s\t?\t?\t%s\t?\t?\n", name, humanBytes(e.StoredBytes))
			fmt.Fprintf(errw, "gpucr-stream: ls: %s: %s\n", e.Location, e.Error)
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%.2fx\t%s\n", name, e.Created.Local().Format("2006-01-02 15:04:05"),
			humanBytes(e.RawBytes), humanBytes(e.StoredBytes), e.Ratio, e.Host)
	}
	tw.Flush()
}

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
	return nil
}

func verb(dryRun bool) string {
	if dryRun {
		return "would remove"
	}
	return "removed"
}

// parseAge reads --older-than: a Go duration, or a number of days ("7d").
func parseAge(s string) (time.Duration, error) {
	if d, ok := strings.CutSuffix(strings.TrimSpace(s), "d"); ok {
		n, err := strconv.ParseFloat(d, 64)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("bad age %q", s)
		}
		return time.Duration(n * 24 * float64(time.Hour)), nil
	}
	d, err := time.ParseDuration(strings.TrimSpace(s))
	if err != nil || d < 0 {
		return 0, fmt.Errorf("bad age %q", s)
	}
	return d, nil
}

// runGc removes what unfinished captures left under a location, older
// than --older-than (catalog.GC).
func runGc(ctx context.Context, cfg *config, args []string) error {
	if len(args) != 1 {
		return usagef("gc takes one LOCATION argument, got %d", len(args))
	}
	age, err := parseAge(cfg.olderThan)
	if err != nil {
		return usagef("--older-than: %v (want e.g. 30m, 2h, 7d)", err)
	}
	st, loc, closeStore, err := storeAt(ctx, cfg, "gc", args)
	if err != nil {
		return err
	}
	defer closeStore()
	res, err := catalog.GC(ctx, st, loc.String(), age, cfg.dryRun)
	if err != nil {
		return fmt.Errorf("gc: %w", err)
	}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(res)
	}
	v := verb(cfg.dryRun)
	for _, n := range res.Unfinished {
		fmt.Fprintf(cfg.stdout, "%s unfinished checkpoint %s\n", v, n)
	}
	fmt.Fprintf(cfg.stdout, "gc %s: %s %d unfinished checkpoint(s) (%d objects, %s)", res.Location, v, len(res.Unfinished), res.Objects, humanBytes(res.Bytes))
	if res.HasUploads {
		fmt.Fprintf(cfg.stdout, ", aborted %d incomplete upload(s)", res.Uploads)
	}
	if res.HasTempFiles {
		fmt.Fprintf(cfg.stdout, ", %d temporary file(s)", res.TempFiles)
	}
	fmt.Fprintln(cfg.stdout)
	return nil
}
