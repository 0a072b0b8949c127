package main

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/location"
)

var migrateCommand = command{"migrate", "move process --pid to a receiver: checkpoint straight to --to tcp://HOST:PORT, restored there (CUDA processes too: --cuda, --lock-timeout; --gpu-map on the receiver)", "",
	[]string{"@key", "@encode", "@tcp", "@criu", "@fastpath", "@report", "to", "pid", "leave-running", "cuda", "lock-timeout", "keep-dir"}, runMigrate}

type (
	migrateResult = checkpoint.MigrateResult
	receiveResult = checkpoint.ReceiveResult
)

func runMigrate(ctx context.Context, cfg *config, args []string) error {
	if len(args) > 0 {
		return usagef("migrate: unexpected arguments %q", args)
	}
	if cfg.pid <= 0 {
		return usagef("migrate needs --pid PID")
	}
	dest, err := location.Parse(cfg.to)
	if err != nil || dest.Kind != location.TCP {
		return usagef("migrate needs --to tcp://HOST:PORT (a receiver started with gpucr-stream receive)")
	}
	t, err := cfg.tcpSettings()
	if err != nil {
		return err
	}
	cuda, err := cfg.cudaOptions(true)
	if err != nil {
		return err
	}
	fast, err := cfg.fastPathOptions()
	if err != nil {
		return err
	}
	res, err := checkpoint.Migrate(ctx, checkpoint.MigrateOptions{PID: cfg.pid, Dest: dest, TCP: t, Stream: cfg.opts,
		CRIU: cfg.criuOptions(), LeaveRunning: cfg.leaveRunning, KeepDir: cfg.keepDir, NoKeep: cfg.keepDir == "none",
		CUDA: cuda, FastPath: fast, Tool: "gpucr-stream " + version, Hooks: cfg.hooks()})
	if err != nil {
		return err
	}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(res)
	}
	printMigrate(cfg, res)
	return nil
}

func printMigrate(cfg *config, res *migrateResult) {
	w := cfg.stdout
	if res.RestoredPID > 0 {
		fmt.Fprintf(w, "migrated process %d to %s: restored there as %d, downtime %.2fs\n", res.PID, res.Destination, res.RestoredPID, res.DowntimeSecs)
	} else {
		fmt.Fprintf(w, "migrated process %d to %s (served there to criu restore), dump took %.2fs\n", res.PID, res.Destination, res.DowntimeSecs)
	}
	for _, p := range res.Phases {
		fmt.Fprintf(w, "  %-30s %7.3fs\n", p.Name, p.Secs)
	}
	fmt.Fprintf(w, "  %d files, %s raw, %s on the wire (%.2fx) over %d stream(s)\n", res.Files, humanBytes(res.RawBytes), humanBytes(res.WireBytes), res.WireRatio, res.Streams)
	printGPUs(w, res.CUDAPIDs, res.GPUs)
	if res.KeptImage != "" {
		fmt.Fprintf(w, "  image kept at %s until you remove it\n", res.KeptImage)
	}
}
