package main

import (
	"context"
	"fmt"
	"time"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/redact"
	"github.com/gpucr/gpucr-stream/source"
)

var verifyCommand = command{"verify", "decode a checkpoint and check every checksum and hash: verify SRC", "[SRC]",
	func() options { return &verifyOptions{} }}

type verifyOptions struct {
	loc locationFlags
	src fromFlag
}

func (o *verifyOptions) register(f *flags) {
	f.show("json", "no-progress")
	o.loc.register(f.narrow(keyNames, decodeNames, s3ReadNames))
	o.src.register(f)
	f.describe("from", "the checkpoint at rest (or give it as SRC): - (stdin), an archive directory, s3://BUCKET/PREFIX/NAME, or a stream file")
	f.describe("memory-limit", "memory for chunks in flight (auto: 1GiB; reading a stream: half the available memory, at least 1GiB)")
	f.describe("spill-dir", "where a stream's chunks that do not fit in --memory-limit while they are decoded go (default: $TMPDIR)")
}

func (o *verifyOptions) run(ctx context.Context, c *cli, args []string) error {
	from, err := o.src.src(c, "verify", args)
	if err != nil {
		return err
	}
	start := time.Now()
	rep, err := o.verify(ctx, c, from)
	if c.json {
		// Scripts read the verdict from the JSON, failed or not; the exit
		// code says it too.
		res := verifyResult{OK: err == nil, Source: redact.URL(from), VerifyReport: rep, DurationMS: time.Since(start).Milliseconds()}
		if err != nil {
			res.Error = err.Error()
		}
		if jerr := c.printJSON(res); err == nil {
			err = jerr
		}
		return err
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(c.stdout, "ok: %d files, %s checked in %s\n", rep.Files, humanBytes(rep.Bytes), time.Since(start).Round(time.Millisecond))
	return nil
}

type verifyResult struct {
	OK     bool   `json:"ok"`
	Source string `json:"source"`
	Error  string `json:"error,omitempty"`
	source.VerifyReport
	DurationMS int64 `json:"duration_ms"`
}

// verify decodes everything of from and checks it.
func (o *verifyOptions) verify(ctx context.Context, c *cli, from string) (source.VerifyReport, error) {
	var rep source.VerifyReport
	loc, err := parseLoc("source", from)
	if err != nil {
		return rep, fmt.Errorf("verify: %w", err)
	}
	if loc.Kind == location.TCP {
		return rep, usagef("verify: %s: verify reads a checkpoint at rest (a directory, s3://, a stream file or -); a tcp:// transfer is verified as it is received (receive, serve --from tcp://)", from)
	}
	src, err := location.OpenSource(ctx, loc, o.loc.config(c, nil), source.StreamSourceOptions{Discard: true})
	if err != nil {
		return rep, fmt.Errorf("verify: %w", err)
	}
	defer src.Close()
	counters, total := location.SourceCounters(src)
	bar := startProgress(c, checkpoint.Progress{What: "verify", Counters: counters, Total: total})
	defer bar.finish()
	if a := location.ArchiveOf(src); a != nil {
		rep, err = source.VerifyArchive(ctx, a)
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
		return rep, fmt.Errorf("verify %s: %w", redact.URL(from), err)
	}
	return rep, nil
}
