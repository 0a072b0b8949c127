package main

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/gpucr/gpucr-stream/catalog"
)

var checkCommand = command{"check", "check a location's checkpoints and chunk store: check LOCATION (reads only; --repair-index rebuilds a damaged index from the packs)", "LOCATION",
	[]string{"@key", "@s3read", "repair-index", "read-data", "workers", "memory-limit", "json"}, runCheck}

// runCheck reads every pack and manifest of a location and reports what
// is damaged (catalog.Check); exit 3 when anything is.
func runCheck(ctx context.Context, cfg *config, args []string) error {
	st, loc, closeStore, err := storeAt(ctx, cfg, "check", args)
	if err != nil {
		return err
	}
	defer closeStore()
	rep, err := catalog.Check(ctx, st, catalog.CheckOptions{Where: loc.String(), RepairIndex: cfg.repairIndex, ReadData: cfg.readData, Read: cfg.opts})
	if err != nil {
		return fmt.Errorf("check: %w", err)
	}
	if cfg.jsonOut {
		if err := json.NewEncoder(cfg.stdout).Encode(rep); err != nil {
			return err
		}
		return rep.Err()
	}
	w := cfg.stdout
	fmt.Fprintf(w, "check %s: %d checkpoint(s)", rep.Location, rep.Checkpoints)
	if rep.Packs+rep.IndexObjects > 0 {
		fmt.Fprintf(w, " (%d deduplicated); chunk store: %d pack(s) (%s, %d chunks), %d index object(s)",
			rep.Dedup, rep.Packs, humanBytes(rep.PackBytes), rep.Chunks, rep.IndexObjects)
	}
	fmt.Fprintln(w)
	for _, p := range rep.BadIndex {
		fmt.Fprintf(w, "unreadable index object %s: %s\n", p.Name, p.Error)
	}
	if rep.StaleIndex > 0 {
		fmt.Fprintf(w, "index: %d chunk(s) listed where the packs hold no such frame (first: %s)\n", rep.StaleIndex, rep.StaleExample)
	}
	if rep.Unindexed > 0 {
		fmt.Fprintf(w, "index: %d chunk(s) of the packs are in no index object (captures store them again)\n", rep.Unindexed)
	}
	if r := rep.Repaired; r != nil {
		fmt.Fprintf(w, "repaired the index: wrote %s (%d chunks), removed %d index object(s)\n", r.Written, r.Chunks, r.Removed)
	}
	for _, p := range rep.BadPacks {
		fmt.Fprintf(w, "damaged pack %s: %s\n", p.Name, p.Error)
	}
	for _, p := range rep.Damaged {
		fmt.Fprintf(w, "damaged checkpoint %s: %s\n", p.Name, p.Error)
	}
	if rep.ReadData {
		fmt.Fprintf(w, "read-data: %d checkpoint(s) decoded whole, %s checked\n", rep.Verified, humanBytes(rep.Bytes))
		for _, p := range rep.NotRead {
			fmt.Fprintf(w, "not read %s: %s\n", p.Name, p.Error)
		}
	}
	if rep.OK {
		fmt.Fprintln(w, "no damage found")
	}
	return rep.Err()
}
