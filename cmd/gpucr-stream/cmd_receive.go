package main

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/source"
)

var receiveCommand = command{"receive", "accept one checkpoint on --listen HOST:PORT and serve it to criu restore (--restore: restore it and print the PID)", "",
	[]string{"@key", "@decode", "@tcpin", "@criu", "@container", "@report", "images-dir", "listen", "restore", "lazy-pages", "cuda", "gpu-map"}, runReceive}

func runReceive(ctx context.Context, cfg *config, args []string) error {
	if len(args) > 0 {
		return usagef("receive takes no arguments (got %q)", args)
	}
	if cfg.listen == "" {
		return usagef("receive needs --listen HOST:PORT")
	}
	o := checkpoint.ReceiveOptions{Listen: cfg.listen, Restore: cfg.restoreArg, ImagesDir: cfg.imagesDir,
		CRIU: cfg.criuOptions(), Hooks: cfg.hooks()}
	if cfg.container != "" && (!cfg.restoreArg || cfg.lazyPages) {
		return usagef("receive --container restores the container: it needs --restore (without --lazy-pages)")
	}
	if err := cfg.restoreAs(ctx, &o.CRIU); err != nil {
		return err
	}
	var err error
	if o.TCP.Auth, err = cfg.tcpAuth(); err != nil {
		return err
	}
	if o.TCP.Timeout, err = cfg.tcpTimeout(); err != nil {
		return err
	}
	if cfg.lazyPages && !cfg.restoreArg {
		return usagef("--lazy-pages is a way to restore: it needs --restore")
	}
	o.LazyPages = cfg.lazyPages
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
	o.Stream = cfg.locationConfig().StreamSourceOptions(source.StreamSourceOptions{})
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
