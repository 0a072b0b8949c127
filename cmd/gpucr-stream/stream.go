package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/criusock"
)

// statsLine writes criu-image-streamer's statistics line to --progress-fd.
func (c *config) statsLine(st *checkpoint.Stats) {
	b, _ := json.Marshal(st)
	fmt.Fprintln(c.progress, string(b))
}

// runStream is capture, serve or extract, which CRIU runs beside.
func runStream(ctx context.Context, cfg *config, args []string, name, use string,
	fn func(context.Context, checkpoint.DropInOptions) (*checkpoint.Stats, error)) error {
	if len(args) > 0 {
		return usagef("%s takes no arguments (got %q); use %s", name, args, use)
	}
	cfg.dropInProgress = true
	// The location: DEST for capture, SRC for the others.
	loc, err := parseLoc("--to", cfg.to)
	if name != "capture" {
		loc, err = parseLoc("source", cfg.from)
	}
	if err != nil {
		return err
	}
	if name == "capture" {
		if err := cfg.refuseTerminal(loc); err != nil {
			return err
		}
	}
	if err := cfg.needImagesDir(name); err != nil {
		return err
	}
	var remap map[uint16]uint16
	if cfg.tcpRemap != "" {
		if remap, err = criusock.ParseTCPRemap(cfg.tcpRemap); err != nil {
			return usagef("--tcp-listen-remap: %v", err)
		}
	}
	// The statistics line is written by the hooks, when the real tool writes it.
	_, err = fn(ctx, checkpoint.DropInOptions{ImagesDir: cfg.imagesDir, Loc: loc, Open: cfg.locationConfig(),
		ExtFiles: cfg.extFileList(), Producers: cfg.producers, Tool: "gpucr-stream " + version, Hooks: cfg.hooks(), Carry: cfg.carryList(),
		ConnectTimeout: cfg.connectTimeout, TCPListenRemap: remap, Early: cfg.serveEarly})
	if errors.Is(err, criusock.ErrNoCRIU) {
		hint := ""
		if p := filepath.Join(cfg.imagesDir, criusock.CaptureSocket); len(p) >= criusock.MaxSocketPath {
			// CRIU cuts DIR/streamer-*.sock at sun_path's size.
			hint = " (--images-dir is too long for criu to reach directly: give criu -D /proc/PID/fd/N of a process holding it open, as gpucr-stream swrk does, or a short symlink)"
		}
		return fmt.Errorf("%w: start criu with -D set to --images-dir once socket-init is printed, or wait longer with --connect-timeout (0: forever)%s", err, hint)
	}
	return err
}
