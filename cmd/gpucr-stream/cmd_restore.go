package main

import (
	"context"
	"fmt"

	"github.com/gpucr/gpucr-stream/checkpoint"
)

var restoreCommand = command{"restore", "restore a checkpoint from --from (or SRC) with criu and print the new PID", "[SRC]",
	func() options { return &restoreOptions{} }}

type restoreOptions struct {
	loc       locationFlags
	criu      criuFlags
	container containerFlags
	cuda      cudaFlags
	src       fromFlag
	producers int
}

func (o *restoreOptions) register(f *flags) {
	f.show(reportNames...)
	o.loc.register(f.narrow(keyNames, decodeNames, s3ReadNames, tcpListenNames))
	o.criu.register(f)
	o.container.register(f.narrow(restoreContainerNames))
	o.cuda.register(f.narrow(resumeNames))
	o.src.register(f)
	f.num(&o.producers, "producers")
	f.describe("from", "the checkpoint (or give it as SRC): - (stdin), an archive directory, s3://BUCKET/PREFIX/NAME, a stream file, or tcp://HOST:PORT (listen there for one sender: capture or checkpoint --to tcp://)")
	f.describe("container", "the container to restore as, managed by its runtime afterwards")
	f.describe("carry", "carried files (checkpoint --carry) to wait for in a stream before criu starts, comma-separated; an archive's are all written back into the images dir")
	f.describe("producers", "VRAM producers (vram pull) the restore waits for: it does not end before that many have connected and taken their files")
}

func (o *restoreOptions) run(ctx context.Context, c *cli, args []string) error {
	from, err := o.src.src(c, "restore", args)
	if err != nil {
		return err
	}
	src, err := parseLoc("source", from)
	if err != nil {
		return err
	}
	cuda, err := o.cuda.options(false)
	if err != nil {
		return err
	}
	gpuMap, err := parseGPUMap(o.cuda.gpuMap)
	if err != nil {
		return err
	}
	criu := o.criu.options()
	if err := o.container.restoreAs(ctx, &criu); err != nil {
		return err
	}
	res, err := checkpoint.Restore(ctx, checkpoint.RestoreOptions{Src: src, Open: o.loc.config(c, nil), CRIU: criu,
		Producers: o.producers, CUDA: cuda, GPUMap: gpuMap, Hooks: c.hooks()})
	if err != nil {
		return err
	}
	if c.json {
		return c.printJSON(res)
	}
	printPhases(c.stderr, "restore", res.Phases, res.TotalSecs)
	fmt.Fprintln(c.stdout, res.PID)
	return nil
}
