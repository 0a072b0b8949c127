package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/capture"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/redact"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/streamer"
)

// shardStats is criu-image-streamer's statistics line, which scripts parse;
// the other fields are ours.
type shardStats struct {
	Size           int64 `json:"size"`
	TransferMillis int64 `json:"transfer_duration_millis"`
}

type statsLine struct {
	Shards      []shardStats `json:"shards"`
	Files       int          `json:"files"`
	RawBytes    int64        `json:"raw_bytes"`
	StoredBytes int64        `json:"stored_bytes"`
	Ratio       float64      `json:"ratio,omitempty"`
	DurationMS  int64        `json:"duration_ms"`
	Destination string       `json:"destination,omitempty"`
	Source      string       `json:"source,omitempty"`
}

func (c *config) progressLine(s string) {
	fmt.Fprintln(c.progress, s)
}

func (c *config) statsLine(st statsLine) {
	b, _ := json.Marshal(st)
	fmt.Fprintln(c.progress, string(b))
}

func asFile(w any, fallback *os.File) *os.File {
	if f, ok := w.(*os.File); ok {
		return f
	}
	return fallback
}

// openOutput turns --to into a pipeline output.
func openOutput(ctx context.Context, cfg *config) (streamer.Output, func() []int64, error) {
	loc, err := location.Parse(cfg.to)
	if err != nil {
		return nil, nil, usagef("--to: %v", err)
	}
	switch loc.Kind {
	case location.Stdio:
		files, _, err := location.ShardFiles(cfg.shards, asFile(cfg.stdout, os.Stdout))
		if err != nil {
			return nil, nil, usagef("--shard-fds: %v", err)
		}
		ws := make([]io.Writer, len(files))
		for i, f := range files {
			if err := location.PrivateOutput(f); err != nil {
				return nil, nil, err
			}
			ws[i] = f
		}
		if _, ok := cfg.stdout.(*os.File); !ok && len(cfg.shards) == 0 {
			ws[0] = cfg.stdout // tests hand in writers
		}
		out, err := streamer.NewStreamOutput(ws)
		if err != nil {
			return nil, nil, err
		}
		return out, out.Sizes, nil
	case location.Archive:
		store := dir.New(loc.Path)
		out, err := streamer.NewArchiveOutput(ctx, store, cfg.segSize)
		if err != nil {
			return nil, nil, err
		}
		return out, nil, nil
	case location.StreamFile:
		return nil, nil, usagef("--to %s: a file is already there; capture writes archive directories (or use stdout: capture > FILE)", loc)
	case location.S3:
		return openS3Output(ctx, cfg, loc)
	case location.TCP:
		return openTCPOutput(ctx, cfg, loc)
	}
	return nil, nil, usagef("--to %s: this destination is not supported yet", loc)
}

// startCapture opens --to and starts the pipeline writing into it; sizes
// reports per-shard bytes for stream destinations (nil for archives).
func startCapture(ctx context.Context, cfg *config) (c *streamer.Capture, sizes func() []int64, err error) {
	out, sizes, err := openOutput(ctx, cfg)
	if err != nil {
		return nil, nil, err
	}
	if c, err = streamer.NewCapture(ctx, out, cfg.opts); err != nil {
		_ = out.Abort(ctx)
		return nil, nil, err
	}
	return c, sizes, nil
}

func runCapture(ctx context.Context, cfg *config, args []string) error {
	if len(args) > 0 {
		return usagef("capture takes no arguments (got %q); use --to DEST", args)
	}
	if err := cfg.needImagesDir("capture"); err != nil {
		return err
	}
	start := time.Now()
	c, sizes, err := startCapture(ctx, cfg)
	if err != nil {
		return err
	}
	bar := startProgress(cfg, "capture", &c.Counters, 0)
	var ext sync.WaitGroup
	extErrs := make(chan error, len(cfg.extFiles))
	for _, e := range cfg.extFiles {
		ext.Add(1)
		go func() {
			defer ext.Done()
			f := os.NewFile(uintptr(e.fd), "ext file "+e.name)
			defer f.Close()
			if _, err := c.WriteFile(e.name, f, true); err != nil {
				extErrs <- fmt.Errorf("ext file %s (fd %d): %w", e.name, e.fd, err)
			}
		}()
	}
	res, err := capture.IntakeWith(ctx, cfg.imagesDir, c, capture.IntakeOptions{Hooks: capture.Hooks{
		Listening: func() { cfg.progressLine("socket-init") },
		Connected: func() { cfg.progressLine("checkpoint-start") },
	}, Producers: cfg.producers})
	ext.Wait()
	close(extErrs)
	if err == nil {
		err = <-extErrs
	}
	if err == nil && !res.Complete {
		err = errors.New("criu closed the connection without sending inventory.img: the dump did not finish")
	}
	if err != nil {
		c.Abort(err)
		_, _ = c.Close(ctx, manifest.Manifest{})
		bar.finish()
		return fmt.Errorf("capture: %w", err)
	}
	m, err := c.Close(ctx, manifest.Manifest{Tool: "gpucr-stream " + version})
	bar.finish()
	if err != nil {
		return fmt.Errorf("capture: %w", err)
	}
	elapsed := time.Since(start)
	st := statsLine{Files: len(m.Files), RawBytes: m.Stats.RawBytes, StoredBytes: m.Stats.StoredBytes, Ratio: m.Stats.Ratio(),
		DurationMS: elapsed.Milliseconds(), Destination: redact.URL(cfg.to)}
	if sizes != nil {
		for _, n := range sizes() {
			st.Shards = append(st.Shards, shardStats{Size: n, TransferMillis: elapsed.Milliseconds()})
		}
	} else {
		for _, s := range m.Segments {
			st.Shards = append(st.Shards, shardStats{Size: s.Size, TransferMillis: elapsed.Milliseconds()})
		}
	}
	cfg.statsLine(st)
	return nil
}

// openSource turns --from into a source; extractDir makes a stream source
// write files out as they complete.
func openSource(ctx context.Context, cfg *config, from string, so streamer.StreamOptions) (streamer.Source, error) {
	loc, err := location.Parse(from)
	if err != nil {
		return nil, usagef("source: %v", err)
	}
	so = cfg.streamOptions(so)
	switch loc.Kind {
	case location.Stdio:
		files, names, err := location.ShardFiles(cfg.shards, asFile(cfg.stdin, os.Stdin))
		if err != nil {
			return nil, usagef("--shard-fds: %v", err)
		}
		rs := make([]io.Reader, len(files))
		for i, f := range files {
			rs[i] = f
		}
		if len(cfg.shards) == 0 {
			if _, ok := cfg.stdin.(*os.File); !ok {
				rs[0] = cfg.stdin // tests hand in readers
			}
			names[0] = "stdin"
		}
		return streamer.NewStreamSource(ctx, rs, names, so), nil
	case location.StreamFile:
		f, err := os.Open(loc.Path)
		if err != nil {
			return nil, err
		}
		src := streamer.NewStreamSource(ctx, []io.Reader{f}, []string{loc.Path}, so)
		return closeWith{src, f}, nil
	case location.Archive:
		if _, err := os.Stat(loc.Path); err != nil {
			return nil, fmt.Errorf("%s: %w", loc, errdefs.ErrNotFound)
		}
		opts := cfg.opts
		opts.VerifyHashes = so.VerifyHashes || so.Discard
		return streamer.OpenArchive(ctx, dir.New(loc.Path), opts)
	case location.S3:
		opts := cfg.opts
		opts.VerifyHashes = so.VerifyHashes || so.Discard
		return openS3Source(ctx, cfg, loc, opts)
	case location.TCP:
		return openTCPSource(ctx, cfg, loc, so)
	}
	return nil, usagef("source %s: not supported yet", loc)
}

// closeWith closes an extra resource after the source.
type closeWith struct {
	streamer.Source
	c io.Closer
}

func (c closeWith) Close() error {
	err := c.Source.Close()
	c.c.Close()
	return err
}

// streamOf returns the stream source behind src, if it is one.
func streamOf(src streamer.Source) *streamer.StreamSource {
	switch s := src.(type) {
	case *streamer.StreamSource:
		return s
	case closeWith:
		return streamOf(s.Source)
	}
	return nil
}

// writeExtFiles copies the external files to their descriptors.
func writeExtFiles(ctx context.Context, cfg *config, src streamer.Source) error {
	var wg sync.WaitGroup
	errs := make(chan error, len(cfg.extFiles))
	for _, e := range cfg.extFiles {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f := os.NewFile(uintptr(e.fd), "ext file "+e.name)
			defer f.Close()
			if _, err := src.Copy(ctx, e.name, f); err != nil {
				errs <- fmt.Errorf("ext file %s (fd %d): %w", e.name, e.fd, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

func runServe(ctx context.Context, cfg *config, args []string) error {
	if len(args) > 0 {
		return usagef("serve takes no arguments (got %q); use --from SRC", args)
	}
	if err := cfg.needImagesDir("serve"); err != nil {
		return err
	}
	start := time.Now()
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	src, err := openSource(ctx, cfg, cfg.from, streamer.StreamOptions{})
	if err != nil {
		return err
	}
	defer src.Close()
	var total int64
	var counters *streamer.Counters
	stream := streamOf(src)
	var watch sync.WaitGroup
	if stream != nil {
		counters = &stream.Counters
		// A broken stream must stop the wait for CRIU too, so that a restore
		// started later finds no socket instead of a server that hangs.
		watch.Add(1)
		go func() {
			defer watch.Done()
			if err := stream.Wait(ctx); err != nil {
				cancel(err)
			}
		}()
	} else {
		counters, total = sourceCounters(src)
	}
	bar := startProgress(cfg, "restore", counters, total)
	var extErr error
	var ext sync.WaitGroup
	ext.Add(1)
	go func() {
		defer ext.Done()
		extErr = writeExtFiles(ctx, cfg, src)
	}()
	res, err := capture.ServeWith(ctx, cfg.imagesDir, src, capture.ServeOptions{Hooks: capture.Hooks{
		Listening: func() { cfg.progressLine("socket-init") },
	}, Producers: cfg.producers})
	if err == nil && stream != nil {
		// CRIU is done; the rest of the stream must still check out.
		err = stream.Wait(ctx)
	}
	if err != nil {
		if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
			err = cause
		}
		cancel(err)
	}
	ext.Wait()
	cancel(nil)
	watch.Wait()
	bar.finish()
	if err == nil {
		err = extErr
	}
	if err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	cfg.statsLine(statsLine{Shards: []shardStats{{Size: res.Bytes, TransferMillis: time.Since(start).Milliseconds()}},
		Files: res.Served, RawBytes: res.Bytes, DurationMS: time.Since(start).Milliseconds(), Source: redact.URL(cfg.from)})
	return nil
}

func runExtract(ctx context.Context, cfg *config, args []string) error {
	if len(args) > 0 {
		return usagef("extract takes no arguments (got %q); use --from SRC", args)
	}
	if err := cfg.needImagesDir("extract"); err != nil {
		return err
	}
	start := time.Now()
	src, err := openSource(ctx, cfg, cfg.from, streamer.StreamOptions{ExtractDir: cfg.imagesDir})
	if err != nil {
		return err
	}
	defer src.Close()
	var files int
	var bytes int64
	if stream := streamOf(src); stream != nil {
		list, err := stream.Files(ctx)
		if err != nil {
			return fmt.Errorf("extract: %w", err)
		}
		for _, f := range list {
			files++
			bytes += f.Size
		}
	} else if files, bytes, err = capture.WriteExtract(ctx, src, cfg.imagesDir); err != nil {
		return fmt.Errorf("extract: %w", err)
	}
	if err := writeExtFiles(ctx, cfg, src); err != nil {
		return fmt.Errorf("extract: %w", err)
	}
	cfg.statsLine(statsLine{Shards: []shardStats{{Size: bytes, TransferMillis: time.Since(start).Milliseconds()}},
		Files: files, RawBytes: bytes, DurationMS: time.Since(start).Milliseconds(), Source: redact.URL(cfg.from)})
	return nil
}
