package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"

	"github.com/gpucr/gpucr-stream/catalog"
	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/ctrtar"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
)

var cpCommand = command{"cp", "copy a checkpoint between locations (directory, s3://): cp SRC DEST; verified before its manifest is written, resumable; to or from a Podman/CRI-O checkpoint archive (checkpointctl's layout: FILE.tar, .tar.gz, .tar.zst)", "SRC DEST",
	[]string{"@key", "@s3", "workers", "memory-limit", "create-bucket", "json", "no-progress"}, runCp}

func runCp(ctx context.Context, cfg *config, args []string) error {
	if len(args) != 2 {
		return usagef("cp takes SRC and DEST, got %d arguments", len(args))
	}
	if archive, toArchive := containerArchive(args); archive != "" {
		return cpArchive(ctx, cfg, args, archive, toArchive)
	}
	srcLoc, err := parseLoc("SRC", args[0])
	if err != nil {
		return err
	}
	dstLoc, err := parseLoc("DEST", args[1])
	if err != nil {
		return err
	}
	src, closeSrc, err := location.OpenStore(ctx, srcLoc, cfg.locationConfig())
	if err != nil {
		return fmt.Errorf("cp: %w", err)
	}
	defer closeSrc()
	dst, closeDst, err := location.OpenDestStore(ctx, dstLoc, cfg.locationConfig())
	if err != nil {
		return fmt.Errorf("cp: %w", err)
	}
	defer closeDst()
	var counters pipeline.Counters
	var total int64
	if m, err := source.ReadManifest(ctx, src); err == nil {
		for _, s := range m.Segments {
			total += s.Size
		}
	}
	bar := startProgress(cfg, checkpoint.Progress{What: "cp", Counters: &counters, Total: total})
	res, err := catalog.Copy(ctx, src, dst, cfg.opts, &counters)
	bar.finish()
	if err != nil {
		return fmt.Errorf("cp %s %s: %w", srcLoc, dstLoc, err)
	}
	res.Source, res.Destination = srcLoc.String(), dstLoc.String()
	for _, b := range res.BadIndex {
		fmt.Fprintf(cfg.stderr, "warning: skipped an unreadable chunk index object at the destination; its chunks were indexed again (`gpucr-stream check --repair-index` of the destination's location rebuilds the index): %s\n", b.Error)
	}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(res)
	}
	if res.Already {
		fmt.Fprintf(cfg.stdout, "%s already holds checkpoint %s\n", res.Destination, res.ID)
		return nil
	}
	fmt.Fprintf(cfg.stdout, "copied %s to %s: %d segment(s) (%d kept from an earlier try), %s copied, %s verified\n",
		res.Source, res.Destination, res.Segments, res.Kept, humanBytes(res.Bytes), humanBytes(res.Verified))
	return nil
}

// containerArchive names the side of cp that is a Podman/CRI-O checkpoint
// archive: SRC if it is a file that starts as one, else DEST if it is
// named as one.
func containerArchive(args []string) (archive string, toArchive bool) {
	if f, err := os.Open(args[0]); err == nil {
		head := make([]byte, 512)
		n, _ := io.ReadFull(f, head)
		f.Close()
		if ctrtar.Sniff(head[:n]) {
			return args[0], false
		}
	}
	if _, ok := ctrtar.CompressionFor(args[1]); ok {
		return args[1], true
	}
	return "", false
}

func cpArchive(ctx context.Context, cfg *config, args []string, archive string, toArchive bool) error {
	other := args[1]
	if toArchive {
		other = args[0]
	}
	loc, err := parseLoc("location", other)
	if err != nil {
		return err
	}
	o := checkpoint.TarOptions{Archive: archive, Loc: loc, Open: cfg.locationConfig(), Tool: "gpucr-stream " + version, Hooks: cfg.hooks()}
	var res *checkpoint.TarResult
	if toArchive {
		res, err = checkpoint.ToTar(ctx, o)
	} else {
		res, err = checkpoint.FromTar(ctx, o)
	}
	if err != nil {
		return err
	}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(res)
	}
	fmt.Fprintf(cfg.stdout, "copied %s to %s: %d files, %s raw\n", res.Source, res.Destination, res.Files, humanBytes(res.RawBytes))
	if res.Container != "" {
		fmt.Fprintf(cfg.stdout, "  %s container %s (restore it with: gpucr-stream restore --container NAME --runtime podman --from %s)\n", res.Engine, res.Container, res.Destination)
	}
	return nil
}
