package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/catalog"
)

var gcCommand = command{"gc", "remove what dead captures left (segments, uploads, temporary files) older than --older-than, and chunks no checkpoint references: gc LOCATION", "LOCATION",
	[]string{"@s3conn", "older-than", "repack-below", "dry-run", "json"}, runGc}

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
// (docs/BENCHMARKS.md, BenchmarkGCFleet). A location so large that the
// table alone passes it still finishes, with the collector working harder.
const gcMemoryLimit = 120 << 20

// runGc removes what dead captures left under a location, older than
// --older-than, and what no checkpoint references (catalog.GC).
func runGc(ctx context.Context, cfg *config, args []string) error {
	if len(args) != 1 {
		return usagef("gc takes one LOCATION argument, got %d", len(args))
	}
	age, err := parseAge(cfg.olderThan)
	if err != nil {
		return usagef("--older-than: %v (want e.g. 30m, 2h, 7d)", err)
	}
	pct, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(cfg.repackBelow), "%"), 64)
	if err != nil || pct < 0 || pct > 100 {
		return usagef("--repack-below: %q is no share of 0%% to 100%%", cfg.repackBelow)
	}
	repack := pct / 100
	if pct == 0 {
		repack = -1 // never
	}
	st, loc, closeStore, err := storeAt(ctx, cfg, "gc", args)
	if err != nil {
		return err
	}
	defer closeStore()
	if _, ok := os.LookupEnv("GOMEMLIMIT"); !ok {
		debug.SetMemoryLimit(gcMemoryLimit)
	}
	res, err := catalog.GC(ctx, st, loc.String(), age, cfg.dryRun, repack)
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
	if cfg.dryRun {
		for _, n := range res.Names {
			fmt.Fprintf(cfg.stdout, "%s %s\n", v, n)
		}
	}
	fmt.Fprintf(cfg.stdout, "gc %s: %s %d unfinished checkpoint(s) (%d objects, %s)", res.Location, v, len(res.Unfinished), res.Objects, humanBytes(res.Bytes))
	if res.HasUploads {
		fmt.Fprintf(cfg.stdout, ", aborted %d incomplete upload(s)", res.Uploads)
	}
	if res.HasTempFiles {
		fmt.Fprintf(cfg.stdout, ", %d temporary file(s) and empty dir(s)", res.TempFiles)
	}
	fmt.Fprintln(cfg.stdout)
	if c := res.Chunks; c != nil {
		if c.Skipped != "" {
			fmt.Fprintf(cfg.stdout, "chunk store: skipped: %s\n", c.Skipped)
		} else {
			fmt.Fprintf(cfg.stdout, "chunk store: %d pack(s), %d referenced; %s %d unreferenced pack(s) (%s)\n", c.Packs, c.Referenced, v, c.Removed, humanBytes(c.RemovedBytes))
			if c.Repacked > 0 {
				what := fmt.Sprintf("repacked %d mostly unreferenced pack(s): %s live into %d new", c.Repacked, humanBytes(c.RepackedBytes), c.RepackedInto)
				if cfg.dryRun {
					what = fmt.Sprintf("would repack %d mostly unreferenced pack(s): %s live", c.Repacked, humanBytes(c.RepackedBytes))
				}
				fmt.Fprintf(cfg.stdout, "chunk store: %s\n", what)
			}
		}
		for _, l := range c.Lost {
			fmt.Fprintf(cfg.stderr, "warning: %s has chunks in no pack of the chunk store (damaged; verify says which)\n", l)
		}
		for _, b := range c.BadIndex {
			fmt.Fprintf(cfg.stderr, "warning: skipped an unreadable chunk index object (left in place; `gpucr-stream check --repair-index %s` rebuilds the index from the packs): %s\n", res.Location, b.Error)
		}
		for _, u := range c.Unresolved {
			fmt.Fprintf(cfg.stderr, "warning: %s has chunks that only an unreadable index object may find\n", u)
		}
	}
	return nil
}
