package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/gpucr/gpucr-stream/capture"
)

// runVRAM is `gpucr-stream vram push|pull --images-dir DIR NAME FILE|- ...`:
// the command-line side of the producer protocol (capture/producer.go) for
// external VRAM dumpers. push sends files into a running capture or
// checkpoint (before CRIU's dump ends); pull takes them from a running
// serve or restore. Several NAME FILE pairs move at once over one
// connection.
func runVRAM(ctx context.Context, cfg *config, args []string) error {
	if len(args) < 3 || (len(args)-1)%2 != 0 {
		return usagef("vram push|pull --images-dir DIR NAME FILE|- [NAME FILE|- ...]")
	}
	action, pairs := args[0], args[1:]
	if action != "push" && action != "pull" {
		return usagef("vram: unknown action %q: want push or pull", action)
	}
	if cfg.imagesDir == "" {
		return usagef("vram %s needs --images-dir DIR (the images dir of the capture or serve)", action)
	}
	stdio := 0
	for i := 0; i < len(pairs); i += 2 {
		if !capture.ValidImageName(pairs[i]) || pairs[i][0] == '.' {
			return usagef("vram %s: %q is not a file name (one path component, not starting with '.')", action, pairs[i])
		}
		if pairs[i+1] == "-" {
			stdio++
		}
	}
	if stdio > 1 {
		return usagef("vram %s: only one file may be -", action)
	}
	producer := fmt.Sprintf("gpucr-stream-vram-%d", os.Getpid())
	start := time.Now()
	// The socket appears when the capture (or serve) starts listening: a
	// producer started beside it waits for it, up to 30 s.
	var cl *capture.Client
	var err error
	sock := capture.CaptureSocket
	if action == "pull" {
		sock = capture.ServeSocket
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		if _, serr := os.Stat(filepath.Join(cfg.imagesDir, sock)); serr == nil {
			if action == "push" {
				cl, err = capture.DialProducer(ctx, cfg.imagesDir, producer)
			} else {
				cl, err = capture.DialPull(ctx, cfg.imagesDir, producer)
			}
			if err == nil || !errors.Is(err, syscall.ECONNREFUSED) {
				break
			}
		} else {
			err = fmt.Errorf("no %s in %s: is a capture or checkpoint (serve or restore for pull) running there?", sock, cfg.imagesDir)
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	var total int64
	for i := 0; i < len(pairs); i += 2 {
		name, file := pairs[i], pairs[i+1]
		wg.Add(1)
		go func() {
			defer wg.Done()
			var n int64
			var err error
			if action == "push" {
				n, err = pushOne(ctx, cfg, cl, name, file)
			} else {
				n, err = pullOne(ctx, cfg, cl, name, file)
			}
			mu.Lock()
			defer mu.Unlock()
			total += n
			if err != nil {
				errs = append(errs, err)
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		if action == "push" {
			cl.Abort() // the checkpoint must not complete without these files
		} else {
			cl.Close()
		}
		return fmt.Errorf("vram %s: %w", action, err)
	}
	if err := cl.Close(); err != nil {
		return fmt.Errorf("vram %s: %w", action, err)
	}
	secs := time.Since(start).Seconds()
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stderr).Encode(map[string]any{"action": action, "files": len(pairs) / 2, "bytes": total, "seconds": secs})
	}
	fmt.Fprintf(cfg.stderr, "vram %s: %d files, %s in %.2fs\n", action, len(pairs)/2, humanBytes(total), secs)
	return nil
}

func pushOne(ctx context.Context, cfg *config, cl *capture.Client, name, file string) (int64, error) {
	var r io.Reader = cfg.stdin
	if file != "-" {
		f, err := os.Open(file)
		if err != nil {
			return 0, err
		}
		defer f.Close()
		r = f
	}
	cr := &countReader{r: r}
	if err := cl.Push(ctx, name, cr); err != nil {
		return cr.n, err
	}
	return cr.n, nil
}

func pullOne(ctx context.Context, cfg *config, cl *capture.Client, name, file string) (int64, error) {
	if file == "-" {
		return cl.Pull(ctx, name, cfg.stdout)
	}
	tmp, err := os.CreateTemp(filepath.Dir(file), "."+filepath.Base(file)+".partial-*")
	if err != nil {
		return 0, err
	}
	n, err := cl.Pull(ctx, name, tmp)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), file)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return n, err
	}
	return n, nil
}

type countReader struct {
	r io.Reader
	n int64
}

func (c *countReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.n += int64(n)
	return n, err
}
