package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
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
	// CUDA processes suspended for the dump, and their GPUs.
	CUDAPIDs  []int          `json:"cuda_pids,omitempty"`
	GPUs      []manifest.GPU `json:"gpus,omitempty"`
	Producers int            `json:"producers,omitempty"`
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
	lockTimeout, err := cfg.lockTimeoutDur()
	if err != nil {
		return err
	}
	// The CUDA processes of the tree: their GPU state is moved into host
	// memory (lock, checkpoint) before CRIU dumps them.
	cc, err := findCUDA(cfg, o.pid)
	if err != nil {
		return fmt.Errorf("checkpoint %d: %w", o.pid, err)
	}
	start := time.Now()
	c, _, err := startCapture(ctx, cfg)
	if err != nil {
		return err
	}
	bar := startProgress(cfg, "checkpoint", &c.Counters, 0)
	defer bar.finish()
	meta := manifest.Manifest{Tool: "gpucr-stream " + version, CRIUVersion: capture.CRIUVersion(ctx, criu)}
	phases := cc.queryGPUs(ctx, &meta)
	// The fast path first (the program's memory into the capture, then
	// released), so that the driver's checkpoint finds little to copy.
	ps, err := cc.fastSuspend(ctx, cfg, c, &meta)
	phases = append(phases, ps...)
	if err != nil {
		// FastSuspend has undone its steps: the process runs on.
		c.Abort(err)
		_, _ = c.Close(ctx, manifest.Manifest{})
		return fmt.Errorf("checkpoint %d: %w", o.pid, err)
	}
	ps, err = cc.suspend(lockTimeout)
	phases = append(phases, ps...)
	if err != nil {
		// Suspend has undone its steps: the process runs on.
		err = errGPUUndone(err, cc.cudaPIDs(), cc.fastUndo(ctx))
		c.Abort(err)
		_, _ = c.Close(ctx, manifest.Manifest{})
		return fmt.Errorf("checkpoint %d: %w", o.pid, err)
	}
	var m *manifest.Manifest
	var closed bool
	rep, err := capture.Dump(ctx, capture.DumpOptions{
		CRIU: criu, PID: o.pid, WorkDir: o.workDir, LeaveRunning: o.leaveRunning,
		ExtraArgs: strings.Fields(o.criuOpts), Producers: o.producers,
		BeforeKill: func(ctx context.Context, res capture.DumpResult) error {
			// The commit point: the manifest is durable before CRIU kills the
			// process; if this fails, CRIU resumes it.
			closed = true
			var err error
			m, err = c.Close(ctx, meta)
			return err
		},
	}, c)
	bar.finish()
	if !closed {
		c.Abort(errors.New("checkpoint did not complete"))
		_, _ = c.Close(ctx, manifest.Manifest{})
	}
	if err != nil {
		return fmt.Errorf("checkpoint %d: %w", o.pid, cc.undo(err))
	}
	phases = append(phases, phase{"criu dump + encode + write", (rep.CRIU - rep.Commit).Seconds()}, phase{"commit", rep.Commit.Seconds()})
	if !o.leaveRunning {
		cc.fastCommit()
	} else {
		ps, rerr := cc.resume()
		phases = append(phases, ps...)
		if rerr != nil {
			return fmt.Errorf("checkpoint %d committed to %s, but resuming its GPU state failed: %w", o.pid, sinks.Redact(cfg.to), rerr)
		}
	}
	res := checkpointResult{PID: o.pid, Destination: sinks.Redact(cfg.to), Files: len(m.Files), RawBytes: m.Stats.RawBytes,
		StoredBytes: m.Stats.StoredBytes, Ratio: m.Stats.Ratio(), LeftRunning: o.leaveRunning,
		Phases: phases, TotalSecs: time.Since(start).Seconds(), CUDAPIDs: cc.cudaPIDs(), GPUs: m.GPUs, Producers: rep.Producers}
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
	printGPUs(cfg.stdout, res.CUDAPIDs, res.GPUs)
	return nil
}

type restoreResult struct {
	PID       int     `json:"pid"`
	Source    string  `json:"source"`
	Files     int     `json:"files"`
	Bytes     int64   `json:"bytes"`
	Phases    []phase `json:"phases"`
	TotalSecs float64 `json:"total_seconds"`
	// CUDA processes brought back onto the GPU.
	CUDAPIDs  []int `json:"cuda_pids,omitempty"`
	Producers int   `json:"producers,omitempty"`
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
	counters, total := sourceCounters(src)
	bar := startProgress(cfg, "restore", counters, total)
	defer bar.finish()
	if err := checkCUDAMode(cfg.cuda); err != nil {
		return err
	}
	var recorded []manifest.GPU
	if a, ok := src.(*streamer.ArchiveSource); ok {
		recorded = a.Manifest().GPUs
	}
	pairs, err := gpuMapFor(cfg.gpuMap, recorded)
	if err != nil {
		return err
	}
	rep, err := capture.Restore(ctx, capture.RestoreOptions{CRIU: criu, WorkDir: o.workDir,
		ExtraArgs: strings.Fields(o.criuOpts), Producers: o.producers}, src)
	bar.finish()
	if err != nil {
		return fmt.Errorf("restore from %s: %w", sinks.Redact(from), err)
	}
	phases := []phase{{"criu restore + read + decode", rep.CRIU.Seconds()}}
	// The restored CUDA processes are still checkpointed: their device
	// memory is in host memory. Put it back on the GPU and let them run.
	cudaPIDs, t, err := cudaRestore(cfg, rep.PID, pairs)
	phases = append(phases, timingPhases(t)...)
	if err != nil {
		return fmt.Errorf("restore from %s: process %d restored, but its GPU state is not: %w", sinks.Redact(from), rep.PID, err)
	}
	// Those that took the fast path wait, parked, for their memory.
	if a, ok := src.(*streamer.ArchiveSource); ok && cfg.cuda != "off" {
		ps, err := fastRestore(ctx, src, a.Manifest().CUDA)
		phases = append(phases, ps...)
		if err != nil {
			return fmt.Errorf("restore from %s: process %d restored, but its device memory is not: %w", sinks.Redact(from), rep.PID, err)
		}
	}
	res := restoreResult{PID: rep.PID, Source: sinks.Redact(from), Files: rep.Served, Bytes: rep.Bytes,
		Phases: phases, TotalSecs: time.Since(start).Seconds(), CUDAPIDs: cudaPIDs, Producers: rep.Producers}
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

// printGPUs names the CUDA processes and GPUs of a checkpoint.
func printGPUs(w io.Writer, pids []int, gpus []manifest.GPU) {
	if len(pids) == 0 {
		return
	}
	fmt.Fprintf(w, "  CUDA processes %v", pids)
	for _, g := range gpus {
		fmt.Fprintf(w, "; %s %s", g.UUID, g.Name)
		if g.Bytes > 0 {
			fmt.Fprintf(w, " (%s of device memory)", humanBytes(g.Bytes))
		}
	}
	fmt.Fprintln(w)
}
