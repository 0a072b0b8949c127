package main

import (
	"context"
	"fmt"

	"github.com/gpucr/gpucr-stream/catalog"
)

var checkCommand = command{"check", "check a location's checkpoints and chunk store: check LOCATION (reads only; --repair-index rebuilds a damaged index from the packs)", "LOCATION",
	func() options { return &checkOptions{} }}

type checkOptions struct {
	loc                   locationFlags
	repairIndex, readData bool
}

func (o *checkOptions) register(f *flags) {
	f.show("json")
	o.loc.register(f.narrow(keyNames, s3ReadNames, bufferNames))
	f.boolean(&o.repairIndex, "repair-index")
	f.boolean(&o.readData, "read-data")
	f.describe("memory-limit", "with --read-data: memory for chunks in flight (auto: 1GiB)")
	f.describe("workers", "with --read-data: decoder goroutines (0: one per core)")
}

// run reads every pack and manifest of a location and reports what is
// damaged (catalog.Check); exit 3 when anything is.
func (o *checkOptions) run(ctx context.Context, c *cli, args []string) error {
	st, loc, closeStore, err := storeAt(ctx, c, &o.loc, "check", args)
	if err != nil {
		return err
	}
	defer closeStore()
	rep, err := catalog.Check(ctx, st, catalog.CheckOptions{Where: loc.String(), RepairIndex: o.repairIndex, ReadData: o.readData, Read: o.loc.options()})
	if err != nil {
		return fmt.Errorf("check: %w", err)
	}
	if c.json {
		if err := c.printJSON(rep); err != nil {
			return err
		}
		return rep.Err()
	}
	w := c.stdout
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
