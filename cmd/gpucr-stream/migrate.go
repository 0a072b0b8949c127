package main

// Live migration: migrate (sender), receive (receiver), token. The work is
// checkpoint.Migrate and checkpoint.Receive; the transport transport/tcp.

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/transport/tcp"
)

type (
	migrateResult = checkpoint.MigrateResult
	receiveResult = checkpoint.ReceiveResult
)

func runToken(ctx context.Context, cfg *config, args []string) error {
	if len(args) > 0 {
		return usagef("token takes no arguments; write it to a file: gpucr-stream token > FILE")
	}
	fmt.Fprintln(cfg.stdout, tcp.NewToken())
	return nil
}

func runReceive(ctx context.Context, cfg *config, args []string) error {
	if len(args) > 0 {
		return usagef("receive takes no arguments (got %q)", args)
	}
	if cfg.listen == "" {
		return usagef("receive needs --listen HOST:PORT")
	}
	o := checkpoint.ReceiveOptions{Listen: cfg.listen, Restore: cfg.restoreArg, ImagesDir: cfg.imagesDir,
		CRIU: cfg.criuOptions(), Hooks: cfg.hooks()}
	var err error
	if o.TCP.Auth, err = cfg.tcpAuth(); err != nil {
		return err
	}
	if o.TCP.Timeout, err = cfg.tcpTimeout(); err != nil {
		return err
	}
	if cfg.restoreArg {
		if o.CUDA, err = cfg.cudaOptions(false); err != nil {
			return err
		}
		// --gpu-map resolves against the GPUs the sender records, which
		// come with its commit; check the rest now, before a sender kills
		// its process for a typo.
		if o.GPUMap, err = parseGPUMap(cfg.gpuMap); err != nil {
			return err
		}
	} else if err := cfg.needImagesDir("receive (without --restore)"); err != nil {
		return err
	}
	o.Stream = cfg.locationConfig().StreamOptions(streamer.StreamOptions{})
	res, err := checkpoint.Receive(ctx, o)
	if err != nil {
		return err
	}
	if res.Stats != nil {
		cfg.statsLine(res.Stats)
	}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(res)
	}
	w := cfg.stderr
	fmt.Fprintf(w, "received %d files, %s raw, %s on the wire, from %s over %d stream(s)\n", res.Files, humanBytes(res.RawBytes), humanBytes(res.WireBytes), res.Peer, res.Streams)
	for _, p := range res.Phases {
		fmt.Fprintf(w, "  %-30s %7.3fs\n", p.Name, p.Secs)
	}
	if res.PID > 0 {
		fmt.Fprintln(cfg.stdout, res.PID)
	}
	return nil
}

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
	res, err := checkpoint.Migrate(ctx, checkpoint.MigrateOptions{PID: cfg.pid, Dest: dest, TCP: t, Stream: cfg.opts,
		CRIU: cfg.criuOptions(), LeaveRunning: cfg.leaveRunning, KeepDir: cfg.keepDir, NoKeep: cfg.keepDir == "none",
		CUDA: cuda, Tool: "gpucr-stream " + version, Hooks: cfg.hooks()})
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
