package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/gpucr/gpucr-stream/capture"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/sinks"
	"github.com/gpucr/gpucr-stream/streamer"
)

// phase is one timed step of a checkpoint or restore.
type phase struct {
	Name string  `json:"name"`
	Secs float64 `json:"seconds"`
}

type checkpointResult struct {
	PID         int     `json:"pid"`
	Destination string  `json:"destination"`
	Files       int     `json:"files"`
	RawBytes    int64   `json:"raw_bytes"`
	StoredBytes int64   `json:"stored_bytes"`
	Ratio       float64 `json:"ratio"`
	Phases      []phase `json:"phases"`
	TotalSecs   float64 `json:"total_seconds"`
	LeftRunning bool    `json:"left_running"`
}

func runCheckpoint(ctx context.Context, cfg *config, args []string) error {
	o := cfg
	if len(args) > 0 {
		return usagef("checkpoint: unexpected arguments %q", args)
	}
	if o.pid <= 0 {
		return usagef("checkpoint needs --pid PID")
	}
	criu, err := capture.FindCRIU(o.criu)
	if err != nil {
		return err
	}
	start := time.Now()
	out, _, err := openOutput(ctx, cfg)
	if err != nil {
		return err
	}
	c, err := streamer.NewCapture(ctx, out, cfg.opts)
	if err != nil {
		_ = out.Abort(ctx)
		return err
	}
	meta := manifest.Manifest{Tool: "gpucr-stream " + version, CRIUVersion: capture.CRIUVersion(ctx, criu)}
	var m *manifest.Manifest
	var closed bool
	rep, err := capture.Dump(ctx, capture.DumpOptions{
		CRIU: criu, PID: o.pid, WorkDir: o.workDir, LeaveRunning: o.leaveRunning,
		BeforeKill: func(ctx context.Context, res capture.DumpResult) error {
			// The commit point: the manifest is durable before CRIU kills the
			// process; if this fails, CRIU resumes it.
			closed = true
			var err error
			m, err = c.Close(ctx, meta)
			return err
		},
	}, c)
	if !closed {
		c.Abort(errors.New("checkpoint did not complete"))
		_, _ = c.Close(ctx, manifest.Manifest{})
	}
	if err != nil {
		return fmt.Errorf("checkpoint %d: %w", o.pid, err)
	}
	res := checkpointResult{PID: o.pid, Destination: sinks.Redact(cfg.to), Files: len(m.Files), RawBytes: m.Stats.RawBytes,
		StoredBytes: m.Stats.StoredBytes, Ratio: m.Stats.Ratio(), LeftRunning: o.leaveRunning,
		Phases:    []phase{{"criu dump + encode + write", (rep.CRIU - rep.Commit).Seconds()}, {"commit", rep.Commit.Seconds()}},
		TotalSecs: time.Since(start).Seconds()}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(res)
	}
	if cfg.to == "-" {
		// stdout carries the stream; the summary goes to stderr.
		printPhases(cfg.stderr, "checkpoint", res.Phases, res.TotalSecs)
		return nil
	}
	printPhases(cfg.stdout, "checkpoint", res.Phases, res.TotalSecs)
	fmt.Fprintf(cfg.stdout, "  %d files, %s raw, %s stored (%.2fx) in %s\n", res.Files, humanBytes(res.RawBytes), humanBytes(res.StoredBytes), res.Ratio, res.Destination)
	return nil
}

type restoreResult struct {
	PID       int     `json:"pid"`
	Source    string  `json:"source"`
	Files     int     `json:"files"`
	Bytes     int64   `json:"bytes"`
	Phases    []phase `json:"phases"`
	TotalSecs float64 `json:"total_seconds"`
}

func runRestore(ctx context.Context, cfg *config, args []string) error {
	o := cfg
	from, err := srcArg(cfg, "restore", args)
	if err != nil {
		return err
	}
	criu, err := capture.FindCRIU(o.criu)
	if err != nil {
		return err
	}
	start := time.Now()
	src, err := openSource(ctx, cfg, from, streamer.StreamOptions{})
	if err != nil {
		return err
	}
	defer src.Close()
	rep, err := capture.Restore(ctx, capture.RestoreOptions{CRIU: criu, WorkDir: o.workDir}, src)
	if err != nil {
		return fmt.Errorf("restore from %s: %w", sinks.Redact(from), err)
	}
	res := restoreResult{PID: rep.PID, Source: sinks.Redact(from), Files: rep.Served, Bytes: rep.Bytes,
		Phases: []phase{{"criu restore + read + decode", rep.CRIU.Seconds()}}, TotalSecs: time.Since(start).Seconds()}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(res)
	}
	printPhases(cfg.stderr, "restore", res.Phases, res.TotalSecs)
	fmt.Fprintln(cfg.stdout, rep.PID)
	return nil
}

func printPhases(w interface{ Write([]byte) (int, error) }, what string, ps []phase, total float64) {
	fmt.Fprintf(w, "%s done in %.2fs\n", what, total)
	for _, p := range ps {
		fmt.Fprintf(w, "  %-30s %7.3fs\n", p.Name, p.Secs)
	}
}
