package main

import (
	"context"
	"fmt"
	"io"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/location"
)

var migrateCommand = command{"migrate", "move process --pid to a receiver: checkpoint straight to --to tcp://HOST:PORT, restored there (CUDA processes too: --cuda, --lock-timeout; --gpu-map on the receiver)", "",
	func() options { return &migrateOptions{} }}

type (
	migrateResult = checkpoint.MigrateResult
	receiveResult = checkpoint.ReceiveResult
)

// migrateOptions: a migration streams to its receiver, never into an
// archive, so it offers no --segment-size or --dedup; its container is
// restored by the receiver (receive --container, --bundle).
type migrateOptions struct {
	loc           locationFlags
	criu          criuFlags
	container     containerFlags
	cuda          cudaFlags
	fast          fastPathFlags
	to, keepDir   string
	pid           int
	leaveRunning  bool
	precopy       string
	precopyRounds int
	precopyShrink int
}

func (o *migrateOptions) register(f *flags) {
	f.show(reportNames...)
	o.loc.register(f.narrow(keyNames, streamNames, tcpSendNames))
	o.criu.register(f)
	o.container.register(f.narrow(checkpointContainerNames))
	o.cuda.register(f.narrow(suspendNames))
	o.fast.register(f)
	f.str(&o.to, "to")
	f.str(&o.keepDir, "keep-dir")
	f.num(&o.pid, "pid")
	f.boolean(&o.leaveRunning, "leave-running")
	f.str(&o.precopy, "precopy")
	f.num(&o.precopyRounds, "precopy-rounds")
	f.num(&o.precopyShrink, "precopy-shrink")
	f.describe("to", "the receiver, tcp://HOST:PORT (gpucr-stream receive --listen HOST:PORT)")
	f.describe("pid", "the process to migrate, with its tree (or --container)")
	f.describe("container", "the container to migrate (its runtime's ID or name), instead of --pid; the receiver restores it with receive --container")
	f.describe("key-file", "encryption key file (mode 0600; make one with: gpucr-stream keygen > FILE), else $GPUCR_KEY: the stream and the kept image are encrypted with it, and the receiver needs it")
	f.describe("carry", "files of CRIU's images dir to carry in the stream, comma-separated (a name in the images dir or an absolute path; runc's descriptors.json always goes): the receiver writes them back")
	f.describe("leave-running", "keep the process running afterwards (the receiver restores a copy)")
}

func (o *migrateOptions) run(ctx context.Context, c *cli, args []string) error {
	if len(args) > 0 {
		return usagef("migrate: unexpected arguments %q", args)
	}
	if o.pid <= 0 && o.container.name == "" {
		return usagef("migrate needs --pid PID or --container ID")
	}
	dest, err := location.Parse(o.to)
	if err != nil || dest.Kind != location.TCP {
		return usagef("migrate needs --to tcp://HOST:PORT (a receiver started with gpucr-stream receive)")
	}
	t, err := o.loc.tcp.settings()
	if err != nil {
		return err
	}
	cuda, err := o.cuda.options(true)
	if err != nil {
		return err
	}
	fast, err := o.fast.options()
	if err != nil {
		return err
	}
	pre, err := o.precopyOptions()
	if err != nil {
		return err
	}
	criu := o.criu.options()
	pid, err := o.container.target(ctx, "migrate", o.pid, &criu)
	if err != nil {
		return err
	}
	res, err := checkpoint.Migrate(ctx, checkpoint.MigrateOptions{PID: pid, Dest: dest, TCP: t, Stream: o.loc.options(),
		CRIU: criu, LeaveRunning: o.leaveRunning, KeepDir: o.keepDir, NoKeep: o.keepDir == "none",
		CUDA: cuda, FastPath: fast, Tool: "gpucr-stream " + version, Hooks: c.hooks(), Precopy: pre})
	if err != nil {
		return err
	}
	if c.json {
		return c.printJSON(res)
	}
	printMigrate(c.stdout, res)
	return nil
}

func (o *migrateOptions) precopyOptions() (checkpoint.PrecopyOptions, error) {
	if o.precopy != "on" && o.precopy != "off" {
		return checkpoint.PrecopyOptions{}, usagef("migrate: --precopy %q: want on or off", o.precopy)
	}
	if o.precopyRounds < 1 || o.precopyRounds > 100 {
		return checkpoint.PrecopyOptions{}, usagef("migrate: --precopy-rounds %d: want 1..100", o.precopyRounds)
	}
	if o.precopyShrink < 1 || o.precopyShrink > 99 {
		return checkpoint.PrecopyOptions{}, usagef("migrate: --precopy-shrink %d: want a percentage, 1..99", o.precopyShrink)
	}
	return checkpoint.PrecopyOptions{Off: o.precopy == "off", Rounds: o.precopyRounds, Shrink: float64(o.precopyShrink) / 100}, nil
}

func printMigrate(w io.Writer, res *migrateResult) {
	if res.RestoredPID > 0 {
		to := ""
		if res.DowntimeTo != "restored" {
			to = " (to " + res.DowntimeTo + ")"
		}
		fmt.Fprintf(w, "migrated process %d to %s: restored there as %d, downtime %.2fs%s\n", res.PID, res.Destination, res.RestoredPID, res.DowntimeSecs, to)
	} else {
		fmt.Fprintf(w, "migrated process %d to %s (served there to criu restore), dump took %.2fs\n", res.PID, res.Destination, res.DowntimeSecs)
	}
	for _, p := range res.Phases {
		fmt.Fprintf(w, "  %-30s %7.3fs\n", p.Name, p.Secs)
	}
	fmt.Fprintf(w, "  %d files, %s raw, %s on the wire (%.2fx) over %d stream(s)\n", res.Files, humanBytes(res.RawBytes), humanBytes(res.WireBytes), res.WireRatio, res.Streams)
	if p := res.Precopy; p != nil && p.Method != "off" {
		for i, r := range p.Rounds {
			fmt.Fprintf(w, "  pre-copy round %d: %s dumped, %s sent in %.2fs\n", i+1, humanBytes(r.RawBytes), humanBytes(r.SentBytes), r.Secs)
		}
		fmt.Fprintf(w, "  final dump: %s on the wire, %s by reference (%s)\n", humanBytes(p.FinalWireBytes), humanBytes(p.FinalRefBytes), p.Method)
	} else if p != nil {
		fmt.Fprintf(w, "  no pre-copy: %s\n", p.Why)
	}
	printGPUs(w, res.CUDAPIDs, res.GPUs)
	if res.KeptImage != "" {
		fmt.Fprintf(w, "  image kept at %s until you remove it\n", res.KeptImage)
	}
}
