package main

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/location"
)

var migrateCommand = command{"migrate", "move process --pid to a receiver: checkpoint straight to --to tcp://HOST:PORT, restored there (CUDA processes too: --cuda, --lock-timeout; --gpu-map on the receiver)", "",
	[]string{"@key", "@encode", "@tcp", "@criu", "@container", "@fastpath", "@report", "to", "pid", "leave-running", "cuda", "lock-timeout", "keep-dir", "precopy", "precopy-rounds", "precopy-shrink"}, runMigrate}

type (
	migrateResult = checkpoint.MigrateResult
	receiveResult = checkpoint.ReceiveResult
)

func runMigrate(ctx context.Context, cfg *config, args []string) error {
	if len(args) > 0 {
		return usagef("migrate: unexpected arguments %q", args)
	}
	if cfg.pid <= 0 && cfg.container == "" {
		return usagef("migrate needs --pid PID or --container ID")
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
	if cfg.precopy != "on" && cfg.precopy != "off" {
		return usagef("migrate: --precopy %q: want on or off", cfg.precopy)
	}
	if cfg.precopyMax < 1 || cfg.precopyMax > 100 {
		return usagef("migrate: --precopy-rounds %d: want 1..100", cfg.precopyMax)
	}
	if cfg.precopyPct < 1 || cfg.precopyPct > 99 {
		return usagef("migrate: --precopy-shrink %d: want a percentage, 1..99", cfg.precopyPct)
	}
	pre := checkpoint.PrecopyOptions{Off: cfg.precopy == "off", Rounds: cfg.precopyMax, Shrink: float64(cfg.precopyPct) / 100}
	criu := cfg.criuOptions()
	pid, err := cfg.checkpointTarget(ctx, "migrate", &criu)
	if err != nil {
		return err
	}
	res, err := checkpoint.Migrate(ctx, checkpoint.MigrateOptions{PID: pid, Dest: dest, TCP: t, Stream: cfg.opts,
		CRIU: criu, LeaveRunning: cfg.leaveRunning, KeepDir: cfg.keepDir, NoKeep: cfg.keepDir == "none",
		CUDA: cuda, FastPath: fast, Tool: "gpucr-stream " + version, Hooks: cfg.hooks(), Precopy: pre})
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
