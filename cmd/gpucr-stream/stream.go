package main

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/criusock"
)

// dropIn are the options of capture, serve and extract, which CRIU runs
// beside (criu-image-streamer's commands); each narrows them to its own.
type dropIn struct {
	images         imagesFlags
	loc            locationFlags
	criu           criuFlags // --carry
	to, from       string
	producers      int
	connectWait    string
	tcpRemap       string
	early          bool
	connectTimeout time.Duration
	remap          map[uint16]uint16
	f              *flags
}

func (o *dropIn) register(f *flags) {
	f.show(reportNames...)
	o.images.register(f)
	o.loc.register(f)
	o.criu.register(f)
	f.str(&o.to, "to")
	f.str(&o.from, "from")
	f.num(&o.producers, "producers")
	f.str(&o.connectWait, "connect-timeout")
	f.str(&o.tcpRemap, "tcp-listen-remap")
	f.boolean(&o.early, "early")
	o.f = f
	f.check(o.parse)
}

func (o *dropIn) parse() error {
	var err error
	if o.connectTimeout, err = time.ParseDuration(o.connectWait); err != nil || o.connectTimeout < 0 {
		return o.f.bad("connect-timeout", "%q: want a duration such as 30s or 5m (0: wait forever)", o.connectWait)
	}
	if o.connectTimeout == 0 {
		o.connectTimeout = -1 // criusock: no limit
	}
	if o.tcpRemap != "" {
		if o.remap, err = criusock.ParseTCPRemap(o.tcpRemap); err != nil {
			return usagef("--tcp-listen-remap: %v", err)
		}
	}
	return nil
}

// run is capture, serve or extract: fn, with the location given by
// --to (capture) or --from.
func (o *dropIn) run(ctx context.Context, c *cli, args []string, name, use string,
	fn func(context.Context, checkpoint.DropInOptions) (*checkpoint.Stats, error)) error {
	if len(args) > 0 {
		return usagef("%s takes no arguments (got %q); use %s", name, args, use)
	}
	c.dropIn = true
	loc, err := parseLoc("--to", o.to)
	if name != "capture" {
		loc, err = parseLoc("source", o.from)
	}
	if err != nil {
		return err
	}
	if name == "capture" {
		if err := refuseTerminal(c, loc, o.images.shards); err != nil {
			return err
		}
	}
	if err := needImagesDir(o.images.dir, name); err != nil {
		return err
	}
	// The statistics line is written by the hooks, when the real tool writes it.
	_, err = fn(ctx, checkpoint.DropInOptions{ImagesDir: o.images.dir, Loc: loc, Open: o.loc.config(c, o.images.shards),
		ExtFiles: o.images.extFiles, Producers: o.producers, Tool: "gpucr-stream " + version, Hooks: c.hooks(), Carry: o.criu.carryList(),
		ConnectTimeout: o.connectTimeout, TCPListenRemap: o.remap, Early: o.early})
	if errors.Is(err, criusock.ErrNoCRIU) {
		hint := ""
		if p := filepath.Join(o.images.dir, criusock.CaptureSocket); len(p) >= criusock.MaxSocketPath {
			// CRIU cuts DIR/streamer-*.sock at sun_path's size.
			hint = " (--images-dir is too long for criu to reach directly: give criu -D /proc/PID/fd/N of a process holding it open, as gpucr-stream swrk does, or a short symlink)"
		}
		return fmt.Errorf("%w: start criu with -D set to --images-dir once socket-init is printed, or wait longer with --connect-timeout (0: forever)%s", err, hint)
	}
	return err
}
