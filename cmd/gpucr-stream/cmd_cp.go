package main

import (
	"context"
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
	func() options { return &cpOptions{} }}

type cpOptions struct{ loc locationFlags }

func (o *cpOptions) register(f *flags) {
	f.show("json", "no-progress")
	o.loc.register(f.narrow(keyNames, s3WriteNames, bufferNames, []string{"create-bucket"}))
	f.describe("key-file", "encryption key file (mode 0600), else $GPUCR_KEY: an encrypted checkpoint is copied as it is, and verified with the key")
	f.describe("create-bucket", "to s3://: create DEST's bucket if it does not exist (in --s3-region)")
}

func (o *cpOptions) run(ctx context.Context, c *cli, args []string) error {
	if len(args) != 2 {
		return usagef("cp takes SRC and DEST, got %s", plural(len(args), "argument"))
	}
	if archive, toArchive := containerArchive(args); archive != "" {
		return o.archive(ctx, c, args, archive, toArchive)
	}
	srcLoc, err := parseLoc("SRC", args[0])
	if err != nil {
		return err
	}
	dstLoc, err := parseLoc("DEST", args[1])
	if err != nil {
		return err
	}
	src, closeSrc, err := location.OpenStore(ctx, srcLoc, o.loc.config(c, nil))
	if err != nil {
		return fmt.Errorf("cp: %w", err)
	}
	defer closeSrc()
	dst, closeDst, err := location.OpenDestStore(ctx, dstLoc, o.loc.config(c, nil))
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
	bar := startProgress(c, checkpoint.Progress{What: "cp", Counters: &counters, Total: total})
	res, err := catalog.Copy(ctx, src, dst, o.loc.options(), &counters)
	bar.finish()
	if err != nil {
		return fmt.Errorf("cp: %w", err)
	}
	res.Source, res.Destination = srcLoc.String(), dstLoc.String()
	for _, b := range res.BadIndex {
		fmt.Fprintf(c.stderr, "warning: skipped an unreadable chunk index object at the destination; its chunks were indexed again (`gpucr-stream check --repair-index` of the destination's location rebuilds the index): %s\n", b.Error)
	}
	if c.json {
		return c.printJSON(res)
	}
	if res.Already {
		fmt.Fprintf(c.stdout, "%s already holds checkpoint %s\n", res.Destination, res.ID)
		return nil
	}
	fmt.Fprintf(c.stdout, "copied %s to %s: %d segment(s) (%d kept from an earlier try), %s copied, %s verified\n",
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

// archive is cp to or from a Podman/CRI-O checkpoint archive.
func (o *cpOptions) archive(ctx context.Context, c *cli, args []string, archive string, toArchive bool) error {
	other := args[1]
	if toArchive {
		other = args[0]
	}
	loc, err := parseLoc("location", other)
	if err != nil {
		return err
	}
	t := checkpoint.TarOptions{Archive: archive, Loc: loc, Open: o.loc.config(c, nil), Tool: "gpucr-stream " + version, Hooks: c.hooks()}
	var res *checkpoint.TarResult
	if toArchive {
		res, err = checkpoint.ToTar(ctx, t)
	} else {
		res, err = checkpoint.FromTar(ctx, t)
	}
	if err != nil {
		return err
	}
	if c.json {
		return c.printJSON(res)
	}
	fmt.Fprintf(c.stdout, "copied %s to %s: %d files, %s raw\n", res.Source, res.Destination, res.Files, humanBytes(res.RawBytes))
	if res.Container != "" {
		fmt.Fprintf(c.stdout, "  %s container %s (restore it with: gpucr-stream restore --container NAME --runtime podman --from %s)\n", res.Engine, res.Container, res.Destination)
	}
	return nil
}
