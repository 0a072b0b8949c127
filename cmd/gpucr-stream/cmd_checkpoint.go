package main

import (
	"context"
	"fmt"

	"github.com/gpucr/gpucr-stream/checkpoint"
)

var checkpointCommand = command{"checkpoint", "checkpoint process --pid with criu into --to; the checkpoint is committed before CRIU kills it", "",
	func() options { return &checkpointOptions{} }}

type checkpointOptions struct {
	loc          locationFlags
	criu         criuFlags
	container    containerFlags
	cuda         cudaFlags
	fast         fastPathFlags
	to           string
	pid          int
	leaveRunning bool
	producers    int
}

func (o *checkpointOptions) register(f *flags) {
	f.show(reportNames...)
	o.loc.register(f.narrow(keyNames, encodeNames, s3WriteNames, tcpSendNames, []string{"pages-last", "create-bucket"}))
	o.criu.register(f)
	o.container.register(f.narrow(checkpointContainerNames))
	o.cuda.register(f.narrow(suspendNames))
	o.fast.register(f)
	f.str(&o.to, "to")
	f.num(&o.pid, "pid")
	f.boolean(&o.leaveRunning, "leave-running")
	f.num(&o.producers, "producers")
	f.describe("pid", "the process to checkpoint, with its tree (or --container)")
	f.describe("container", "the container to checkpoint (its runtime's ID or name), instead of --pid")
	f.describe("producers", "VRAM producers (vram push) the checkpoint waits for before it is complete")
	f.describe("carry", "files of CRIU's images dir to carry in the checkpoint, comma-separated (a name in the images dir or an absolute path; runc's descriptors.json always goes): restore writes them back")
}

func (o *checkpointOptions) run(ctx context.Context, c *cli, args []string) error {
	if len(args) > 0 {
		return usagef("checkpoint: unexpected arguments %q", args)
	}
	cuda, err := o.cuda.options(true)
	if err != nil {
		return err
	}
	dest, err := parseLoc("--to", o.to)
	if err != nil {
		return err
	}
	if err := refuseNoCopy(c, dest); err != nil {
		return err
	}
	fast, err := o.fast.options()
	if err != nil {
		return err
	}
	criu := o.criu.options()
	pid, err := o.container.target(ctx, "checkpoint", o.pid, &criu)
	if err != nil {
		return err
	}
	res, err := checkpoint.Checkpoint(ctx, checkpoint.Options{PID: pid, Dest: dest, Open: o.loc.config(c, nil),
		CRIU: criu, LeaveRunning: o.leaveRunning, Producers: o.producers, CUDA: cuda, FastPath: fast,
		Tool: "gpucr-stream " + version, Hooks: c.hooks()})
	if err != nil {
		return err
	}
	if c.json {
		return c.printJSON(res)
	}
	if o.to == "-" {
		// stdout carries the stream; the summary goes to stderr.
		printPhases(c.stderr, "checkpoint", res.Phases, res.TotalSecs)
		return nil
	}
	printPhases(c.stdout, "checkpoint", res.Phases, res.TotalSecs)
	fmt.Fprintf(c.stdout, "  %d files, %s raw, %s stored (%.2fx) in %s\n", res.Files, humanBytes(res.RawBytes), humanBytes(res.StoredBytes), res.Ratio, res.Destination)
	printGPUs(c.stdout, res.CUDAPIDs, res.GPUs)
	return nil
}
