package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/catalog"
)

var gcCommand = command{"gc", "remove what dead captures left (segments, uploads, temporary files) older than --older-than, and chunks no checkpoint references: gc LOCATION", "LOCATION",
	func() options { return &gcOptions{} }}

type gcOptions struct {
	loc                    locationFlags
	dryRun                 bool
	olderThan, repackBelow string
}

func (o *gcOptions) register(f *flags) {
	f.show("json")
	o.loc.register(f.narrow(s3ConnNames))
	f.boolean(&o.dryRun, "dry-run")
	f.str(&o.olderThan, "older-than")
	f.str(&o.repackBelow, "repack-below")
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

// gcMemoryLimit is gc's soft memory limit (GOMEMLIMIT, when set, wins).
// What gc holds live is the index table (60 MB for a million chunks) and
// the manifests it reads; left to GOGC, the garbage of large manifests took
// its heap to 134-159 MiB at a million chunks, 108 MiB with this limit
// (docs/bench-log/2026-11.md, BenchmarkGCFleet). A location so large that the
// table alone passes it still finishes, with the collector working harder.
const gcMemoryLimit = 120 << 20

// run removes what dead captures left under a location, older than
// --older-than, and what no checkpoint references (catalog.GC).
func (o *gcOptions) run(ctx context.Context, c *cli, args []string) error {
	if len(args) != 1 {
		return usagef("gc takes one LOCATION argument, got %d", len(args))
	}
	age, err := parseAge(o.olderThan)
	if err != nil {
		return usagef("--older-than: %v (want e.g. 30m, 2h, 7d)", err)
	}
	pct, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(o.repackBelow), "%"), 64)
	if err != nil || pct < 0 || pct > 100 {
		return usagef("--repack-below: %q is no share of 0%% to 100%%", o.repackBelow)
	}
	repack := pct / 100
	if pct == 0 {
		repack = -1 // never
	}
	st, loc, closeStore, err := storeAt(ctx, c, &o.loc, "gc", args)
	if err != nil {
		return err
	}
	defer closeStore()
	if _, ok := os.LookupEnv("GOMEMLIMIT"); !ok {
		debug.SetMemoryLimit(gcMemoryLimit)
	}
	res, err := catalog.GC(ctx, st, loc.String(), age, o.dryRun, repack)
	if err != nil {
		return fmt.Errorf("gc: %w", err)
	}
	if c.json {
		return c.printJSON(res)
	}
	v := verb(o.dryRun)
	for _, n := range res.Unfinished {
		fmt.Fprintf(c.stdout, "%s unfinished checkpoint %s\n", v, n)
	}
	if o.dryRun {
		for _, n := range res.Names {
			fmt.Fprintf(c.stdout, "%s %s\n", v, n)
		}
	}
	fmt.Fprintf(c.stdout, "gc %s: %s %d unfinished checkpoint(s) (%d objects, %s)", res.Location, v, len(res.Unfinished), res.Objects, humanBytes(res.Bytes))
	if res.HasUploads {
		fmt.Fprintf(c.stdout, ", aborted %d incomplete upload(s)", res.Uploads)
	}
	if res.HasTempFiles {
		fmt.Fprintf(c.stdout, ", %d temporary file(s) and empty dir(s)", res.TempFiles)
	}
	fmt.Fprintln(c.stdout)
	if ch := res.Chunks; ch != nil {
		if ch.Skipped != "" {
			fmt.Fprintf(c.stdout, "chunk store: skipped: %s\n", ch.Skipped)
		} else {
			fmt.Fprintf(c.stdout, "chunk store: %d pack(s), %d referenced; %s %d unreferenced pack(s) (%s)\n", ch.Packs, ch.Referenced, v, ch.Removed, humanBytes(ch.RemovedBytes))
			if ch.Repacked > 0 {
				what := fmt.Sprintf("repacked %d mostly unreferenced pack(s): %s live into %d new", ch.Repacked, humanBytes(ch.RepackedBytes), ch.RepackedInto)
				if o.dryRun {
					what = fmt.Sprintf("would repack %d mostly unreferenced pack(s): %s live", ch.Repacked, humanBytes(ch.RepackedBytes))
				}
				fmt.Fprintf(c.stdout, "chunk store: %s\n", what)
			}
		}
		for _, l := range ch.Lost {
			fmt.Fprintf(c.stderr, "warning: %s has chunks in no pack of the chunk store (damaged; verify says which)\n", l)
		}
		for _, b := range ch.BadIndex {
			fmt.Fprintf(c.stderr, "warning: skipped an unreadable chunk index object (left in place; `gpucr-stream check --repair-index %s` rebuilds the index from the packs): %s\n", res.Location, b.Error)
		}
		for _, u := range ch.Unresolved {
			fmt.Fprintf(c.stderr, "warning: %s has chunks that only an unreadable index object may find\n", u)
		}
	}
	printYoung(c.stdout, res, o.olderThan)
	return nil
}

// printYoung says what gc left for being younger than --older-than (after
// rm, the packs only the removed checkpoint used), and how to take it now.
func printYoung(w io.Writer, res *catalog.GCResult, olderThan string) {
	var kept []string
	if c := res.Chunks; c != nil && c.Young > 0 {
		kept = append(kept, fmt.Sprintf("%d unreferenced pack(s) (%s)", c.Young, humanBytes(c.YoungBytes)))
	}
	if res.Young > 0 {
		kept = append(kept, fmt.Sprintf("%d unfinished checkpoint(s)", res.Young))
	}
	if len(kept) == 0 {
		return
	}
	fmt.Fprintf(w, "gc %s: leaves %s younger than --older-than %s (a capture may still be using them); "+
		"`gpucr-stream gc --older-than 0s %s` removes them now, and still nothing a running capture holds\n",
		res.Location, strings.Join(kept, " and "), olderThan, res.Location)
}
