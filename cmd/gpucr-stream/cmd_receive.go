package main

import (
	"context"
	"fmt"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/source"
)

var receiveCommand = command{"receive", "accept one checkpoint on --listen HOST:PORT and serve it to criu restore (--restore: restore it and print the PID)", "",
	func() options { return &receiveOptions{} }}

type receiveOptions struct {
	loc       locationFlags
	criu      criuFlags
	container containerFlags
	cuda      cudaFlags
	imagesDir string
	listen    string
	restore   bool
	lazyPages bool
}

func (o *receiveOptions) register(f *flags) {
	f.show(reportNames...)
	o.loc.register(f.narrow(keyNames, decodeNames, tcpListenNames))
	o.criu.register(f)
	o.container.register(f.narrow(restoreContainerNames))
	o.cuda.register(f.narrow([]string{"cuda", "gpu-map"}))
	f.str(&o.imagesDir, "images-dir")
	f.str(&o.listen, "listen")
	f.boolean(&o.restore, "restore")
	f.boolean(&o.lazyPages, "lazy-pages")
	f.describe("images-dir", "without --restore: CRIU's images directory (criu restore --stream -D DIR), where the checkpoint is served to criu (created if missing)")
	f.describe("container", "with --restore: the container to restore as (migrate --container sent it), managed by its runtime afterwards")
	f.describe("carry", "carried files (migrate --carry) to wait for in the stream before criu starts, comma-separated")
	f.describe("cuda", "with --restore: CUDA processes of the tree: auto (resume those found), on (require them), off (plain CRIU)")
	f.describe("gpu-map", "with --restore: move GPU state from OLD to NEW GPU: OLD_UUID=NEW_UUID[,...] (OLD may be 'all' for one GPU)")
}

func (o *receiveOptions) run(ctx context.Context, c *cli, args []string) error {
	if len(args) > 0 {
		return usagef("receive takes no arguments (got %q)", args)
	}
	if o.listen == "" {
		return usagef("receive needs --listen HOST:PORT")
	}
	r := checkpoint.ReceiveOptions{Listen: o.listen, Restore: o.restore, ImagesDir: o.imagesDir,
		CRIU: o.criu.options(), Hooks: c.hooks()}
	if o.container.name != "" && (!o.restore || o.lazyPages) {
		return usagef("receive --container restores the container: it needs --restore (without --lazy-pages)")
	}
	if err := o.container.restoreAs(ctx, &r.CRIU); err != nil {
		return err
	}
	var err error
	if r.TCP.Auth, err = o.loc.tcp.auth(); err != nil {
		return err
	}
	if r.TCP.Timeout, err = o.loc.tcp.timeout(); err != nil {
		return err
	}
	if o.lazyPages && !o.restore {
		return usagef("--lazy-pages is a way to restore: it needs --restore")
	}
	r.LazyPages = o.lazyPages
	if o.restore {
		if r.CUDA, err = o.cuda.options(false); err != nil {
			return err
		}
		// --gpu-map resolves against the GPUs the sender records, which
		// come with its commit; check the rest now, before a sender kills
		// its process for a typo.
		if r.GPUMap, err = parseGPUMap(o.cuda.gpuMap); err != nil {
			return err
		}
	} else if err := needImagesDir(o.imagesDir, "receive (without --restore)"); err != nil {
		return err
	}
	r.Stream = o.loc.config(c, nil).StreamSourceOptions(source.StreamSourceOptions{})
	res, err := checkpoint.Receive(ctx, r)
	if err != nil {
		return err
	}
	if res.Stats != nil {
		c.statsLine(res.Stats)
	}
	if c.json {
		return c.printJSON(res)
	}
	w := c.stderr
	fmt.Fprintf(w, "received %d files, %s raw, %s on the wire, from %s over %d stream(s)\n", res.Files, humanBytes(res.RawBytes), humanBytes(res.WireBytes), res.Peer, res.Streams)
	for _, p := range res.Phases {
		fmt.Fprintf(w, "  %-30s %7.3fs\n", p.Name, p.Secs)
	}
	if res.PID > 0 {
		fmt.Fprintln(c.stdout, res.PID)
	}
	return nil
}
