package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/gpucr/gpucr-stream/criusock"
)

var vramCommand = command{"vram", "VRAM producers: vram push|pull --images-dir DIR NAME FILE|- (push into a capture, pull from a serve)", "push|pull NAME FILE|- ...",
	func() options { return &vramOptions{} }}

type vramOptions struct{ imagesDir string }

func (o *vramOptions) register(f *flags) {
	f.show("json")
	f.str(&o.imagesDir, "images-dir")
	f.describe("images-dir", "the images directory of the capture or serve (its --images-dir) to push into or pull from")
	f.describe("json", "the result as JSON, on stderr (stdout may carry a file pulled to -)")
}

// run is `gpucr-stream vram push|pull --images-dir DIR NAME FILE|- ...`:
// the command-line side of the producer protocol (criusock.PushFiles,
// criusock.PullFiles) for external VRAM dumpers. push sends files into a
// running capture or checkpoint (before CRIU's dump ends); pull takes them
// from a running serve or restore. Several NAME FILE pairs move at once
// over one connection.
func (o *vramOptions) run(ctx context.Context, c *cli, args []string) error {
	if len(args) < 3 || (len(args)-1)%2 != 0 {
		return usagef("vram push|pull --images-dir DIR NAME FILE|- [NAME FILE|- ...]")
	}
	action, pairs := args[0], args[1:]
	transfer := criusock.PushFiles
	switch action {
	case "push":
	case "pull":
		transfer = criusock.PullFiles
	default:
		return usagef("vram: unknown action %q: want push or pull", action)
	}
	if o.imagesDir == "" {
		return usagef("vram %s needs --images-dir DIR (the images dir of the capture or serve)", action)
	}
	var files []criusock.TransferFile
	stdio := 0
	for i := 0; i < len(pairs); i += 2 {
		if !criusock.ValidImageName(pairs[i]) || pairs[i][0] == '.' {
			return usagef("vram %s: %q is not a file name (one path component, not starting with '.')", action, pairs[i])
		}
		if pairs[i+1] == "-" {
			stdio++
		}
		files = append(files, criusock.TransferFile{Name: pairs[i], Path: pairs[i+1]})
	}
	if stdio > 1 {
		return usagef("vram %s: only one file may be -", action)
	}
	start := time.Now()
	// The socket appears when the capture (or serve) starts listening: a
	// producer started beside it waits for it, up to 30 s.
	total, err := transfer(ctx, criusock.TransferOptions{Dir: o.imagesDir, Producer: fmt.Sprintf("gpucr-stream-vram-%d", os.Getpid()),
		Wait: 30 * time.Second, Stdin: c.stdin, Stdout: c.stdout}, files)
	if err != nil {
		return fmt.Errorf("vram %s: %w", action, err)
	}
	secs := time.Since(start).Seconds()
	if c.json {
		return json.NewEncoder(c.stderr).Encode(map[string]any{"action": action, "files": len(files), "bytes": total, "seconds": secs})
	}
	fmt.Fprintf(c.stderr, "vram %s: %d files, %s in %.2fs\n", action, len(files), humanBytes(total), secs)
	return nil
}
