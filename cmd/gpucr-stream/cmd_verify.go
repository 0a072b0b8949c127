package main

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/redact"
	"github.com/gpucr/gpucr-stream/streamer"
)

var verifyCommand = command{"verify", "decode a checkpoint and check every checksum and hash: verify SRC", "[SRC]",
	[]string{"@key", "@decode", "@s3", "@tcp", "from"}, runVerify}

func runVerify(ctx context.Context, cfg *config, args []string) error {
	from, err := srcArg(cfg, "verify", args)
	if err != nil {
		return err
	}
	start := time.Now()
	loc, err := parseLoc("source", from)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	src, err := location.OpenSource(ctx, loc, cfg.locationConfig(), streamer.StreamOptions{Discard: true})
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	defer src.Close()
	var rep streamer.VerifyReport
	if a, ok := src.(*streamer.ArchiveSource); ok {
		rep, err = streamer.VerifyArchive(ctx, a)
	} else {
		stream := location.StreamOf(src)
		if err = stream.Wait(ctx); err == nil {
			var files []manifest.File
			files, err = stream.Files(ctx)
			rep.Files = len(files)
			rep.Bytes = stream.Counters.RawBytes.Load()
		}
	}
	if err != nil {
		return fmt.Errorf("verify %s: %w", redact.URL(from), err)
	}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(struct {
			OK bool `json:"ok"`
			streamer.VerifyReport
			DurationMS int64 `json:"duration_ms"`
		}{true, rep, time.Since(start).Milliseconds()})
	}
	fmt.Fprintf(cfg.stdout, "ok: %d files, %s checked in %s\n", rep.Files, humanBytes(rep.Bytes), time.Since(start).Round(time.Millisecond))
	return nil
}
