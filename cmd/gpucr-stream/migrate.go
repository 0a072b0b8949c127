package main

// Live migration: migrate (sender), receive (receiver), token, and the
// tcp:// cases of --to and --from. The transport is sinks/tcp*.go.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/capture"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/redact"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/transport/tcp"
	"github.com/gpucr/gpucr-stream/vram"
)

func (c *config) tcpAuth() (tcp.Auth, error) {
	a, err := tcp.LoadAuth(c.tokenFile, c.tlsCert, c.tlsKey, c.tlsCA)
	if err != nil {
		return a, usagef("%v", err)
	}
	for _, f := range []string{c.tokenFile, c.tlsKey} {
		if st, err := os.Stat(f); f != "" && err == nil && st.Mode().Perm()&0o077 != 0 {
			c.logLine(fmt.Sprintf("warning: %s is readable by other users; it holds a secret (chmod 600 %s)", f, f))
		}
	}
	return a, nil
}

func (c *config) tcpTimeout() (time.Duration, error) {
	d, err := time.ParseDuration(c.netTimeout)
	if err != nil || d < time.Second {
		return 0, usagef("--net-timeout %q: want a duration of at least 1s, such as 20s", c.netTimeout)
	}
	return d, nil
}

func (c *config) tcpStreams() (int, error) {
	if c.streams < 1 || c.streams > tcp.MaxStreams {
		return 0, usagef("--streams %d: want 1..%d", c.streams, tcp.MaxStreams)
	}
	return c.streams, nil
}

// logLine writes one diagnostic line to stderr.
func (c *config) logLine(msg string) {
	fmt.Fprintf(c.stderr, "gpucr-stream: %s\n", msg)
}

func (c *config) dialOptions(autoCommit bool) (tcp.SendOptions, error) {
	var o tcp.SendOptions
	var err error
	if o.Auth, err = c.tcpAuth(); err != nil {
		return o, err
	}
	if o.Timeout, err = c.tcpTimeout(); err != nil {
		return o, err
	}
	if o.Streams, err = c.tcpStreams(); err != nil {
		return o, err
	}
	o.AutoCommit = autoCommit
	return o, nil
}

// openTCPOutput is --to tcp://HOST:PORT for capture and checkpoint: they
// cannot tell when the source process is gone, so the receiver is told to
// go ahead as soon as it has acknowledged the stream (migrate does better).
func openTCPOutput(ctx context.Context, cfg *config, loc location.Location) (streamer.Output, func() []int64, error) {
	o, err := cfg.dialOptions(true)
	if err != nil {
		return nil, nil, err
	}
	out, err := tcp.Dial(ctx, loc.Path, o)
	if err != nil {
		return nil, nil, err
	}
	return out, out.Sizes, nil
}

// openTCPSource is --from tcp://HOST:PORT (serve, restore, extract):
// listen there for one sender and return once its checkpoint is complete,
// verified and committed, so that a transfer that breaks fails the command
// before anything is served (serve prints socket-init only then; receive
// is the form that listens on CRIU's socket from the start).
func openTCPSource(ctx context.Context, cfg *config, loc location.Location, so streamer.StreamOptions) (streamer.Source, error) {
	auth, err := cfg.tcpAuth()
	if err != nil {
		return nil, err
	}
	timeout, err := cfg.tcpTimeout()
	if err != nil {
		return nil, err
	}
	l, err := tcp.Listen(ctx, loc.Path, tcp.ListenOptions{Auth: auth, Timeout: timeout, PIDSpace: proc.Space(), Log: cfg.logLine})
	if err != nil {
		return nil, err
	}
	cfg.logLine("listening on " + l.Addr().String())
	src := tcp.NewSource(ctx, l, so)
	if _, err := src.WaitCommitted(ctx); err != nil {
		src.Close()
		return nil, err
	}
	return src, nil
}

func runToken(ctx context.Context, cfg *config, args []string) error {
	if len(args) > 0 {
		return usagef("token takes no arguments; write it to a file: gpucr-stream token > FILE")
	}
	if f, ok := cfg.stdout.(*os.File); ok {
		if err := location.PrivateOutput(f); err != nil {
			return err
		}
	}
	fmt.Fprintln(cfg.stdout, tcp.NewToken())
	return nil
}

type receiveResult struct {
	PID         int     `json:"pid,omitempty"`
	Listen      string  `json:"listen"`
	Peer        string  `json:"peer,omitempty"`
	Session     string  `json:"session,omitempty"`
	Streams     int     `json:"streams,omitempty"`
	Files       int     `json:"files"`
	RawBytes    int64   `json:"raw_bytes"`
	StreamBytes int64   `json:"stream_bytes"`
	WireBytes   int64   `json:"wire_bytes"`
	Phases      []phase `json:"phases"`
	TotalSecs   float64 `json:"total_seconds"`
	LeftRunning bool    `json:"source_left_running,omitempty"`
	// CUDA processes brought back onto the GPU.
	CUDAPIDs []int `json:"cuda_pids,omitempty"`
}

func runReceive(ctx context.Context, cfg *config, args []string) error {
	if len(args) > 0 {
		return usagef("receive takes no arguments (got %q)", args)
	}
	if cfg.listen == "" {
		return usagef("receive needs --listen HOST:PORT")
	}
	auth, err := cfg.tcpAuth()
	if err != nil {
		return err
	}
	timeout, err := cfg.tcpTimeout()
	if err != nil {
		return err
	}
	var criu string
	if cfg.restoreArg {
		if criu, err = capture.FindCRIU(cfg.criu); err != nil {
			return err
		}
		if err := checkCUDAMode(cfg.cuda); err != nil {
			return err
		}
		// --gpu-map resolves against the GPUs the sender records, which
		// come with its commit; check the rest now, before a sender kills
		// its process for a typo.
		if !strings.HasPrefix(cfg.gpuMap, "all=") {
			if _, err := gpuMapFor(cfg.gpuMap, nil); err != nil {
				return err
			}
		}
	} else if err := cfg.needImagesDir("receive (without --restore)"); err != nil {
		return err
	}
	start := time.Now()
	l, err := tcp.Listen(ctx, cfg.listen, tcp.ListenOptions{Auth: auth, Timeout: timeout, Reports: true, Restores: cfg.restoreArg,
		PIDSpace: proc.Space(), Log: cfg.logLine})
	if err != nil {
		return err
	}
	src := tcp.NewSource(ctx, l, cfg.streamOptions(streamer.StreamOptions{}))
	defer src.Close()
	cfg.logLine("receive: listening on " + l.Addr().String())
	res := receiveResult{Listen: l.Addr().String()}
	fill := func() {
		if s := src.Session(); s != nil {
			res.Peer, res.Session, res.Streams = s.Peer, s.ID, s.Streams()
			res.StreamBytes, res.WireBytes = s.StreamBytes(), s.WireBytes()
			if c := src.Counters(); c != nil {
				res.Files, res.RawBytes = int(c.Files.Load()), c.RawBytes.Load()
			}
			res.Phases = []phase{{"wait for the sender", src.Accepted.Sub(start).Seconds()}}
			if !src.Verified.IsZero() {
				res.Phases = append(res.Phases, phase{"receive + verify", src.Verified.Sub(src.Accepted).Seconds()})
			}
			if !src.Committed.IsZero() {
				res.Phases = append(res.Phases, phase{"sender commits (source gone)", src.Committed.Sub(src.Verified).Seconds()})
			}
		}
	}
	if cfg.restoreArg {
		cfg.progressLine("socket-init")
		ci, err := src.WaitCommitted(ctx)
		if err != nil {
			return fmt.Errorf("receive: %w", err)
		}
		res.LeftRunning = ci.LeftRunning
		rstart := time.Now()
		var rep capture.RestoreReport
		pairs, err := gpuMapFor(cfg.gpuMap, ci.GPUs)
		if err == nil {
			rep, err = capture.Restore(ctx, capture.RestoreOptions{CRIU: criu, WorkDir: cfg.workDir, ExtraArgs: strings.Fields(cfg.criuOpts)}, src)
			if err != nil {
				err = fmt.Errorf("restore: %w", err)
			}
		}
		criuSecs := time.Since(rstart).Seconds()
		report, cudaPIDs, t, err := finishRestore(cfg, rep, err, pairs)
		report.RestoreSecs = time.Since(rstart).Seconds()
		if rerr := src.Report(report); rerr != nil {
			cfg.logLine(fmt.Sprintf("receive: could not report to the sender: %v", rerr))
		}
		if err != nil {
			return fmt.Errorf("receive: %w", err)
		}
		fill()
		res.PID, res.CUDAPIDs = rep.PID, cudaPIDs
		res.Phases = append(res.Phases, phase{"criu restore", criuSecs})
		res.Phases = append(res.Phases, timingPhases(t)...)
	} else {
		// Serve an external `criu restore --stream`; a transfer that breaks
		// must end the wait for it too.
		sctx, cancel := context.WithCancelCause(ctx)
		defer cancel(nil)
		go func() {
			select {
			case <-src.Done():
				if _, err := src.WaitCommitted(sctx); err != nil {
					cancel(err)
				}
			case <-sctx.Done():
			}
		}()
		sres, err := capture.Serve(sctx, cfg.imagesDir, src, capture.Hooks{Listening: func() { cfg.progressLine("socket-init") }})
		if cause := context.Cause(sctx); err != nil && cause != nil && !errors.Is(cause, context.Canceled) {
			err = cause
		}
		report := tcp.Report{Served: sres.Served}
		if err != nil {
			report.Error = err.Error()
		}
		if src.Session() != nil {
			if rerr := src.Report(report); rerr != nil {
				cfg.logLine(fmt.Sprintf("receive: could not report to the sender: %v", rerr))
			}
		}
		if err != nil {
			return fmt.Errorf("receive: %w", err)
		}
		fill()
		cfg.statsLine(statsLine{Shards: []shardStats{{Size: res.StreamBytes, TransferMillis: time.Since(start).Milliseconds()}},
			Files: sres.Served, RawBytes: sres.Bytes, StoredBytes: res.StreamBytes, DurationMS: time.Since(start).Milliseconds(), Source: "tcp://" + res.Listen})
	}
	res.TotalSecs = time.Since(start).Seconds()
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(res)
	}
	w := cfg.stderr
	fmt.Fprintf(w, "received %d files, %s raw, %s on the wire, from %s over %d stream(s)\n", res.Files, humanBytes(res.RawBytes), humanBytes(res.WireBytes), res.Peer, res.Streams)
	for _, p := range res.Phases {
		fmt.Fprintf(w, "  %-30s %7.3fs\n", p.Name, p.Secs)
	}
	if res.PID > 0 {
		fmt.Fprintln(cfg.stdout, res.PID)
	}
	return nil
}

type migrateResult struct {
	PID          int     `json:"pid"`
	RestoredPID  int     `json:"restored_pid,omitempty"`
	Destination  string  `json:"destination"`
	Session      string  `json:"session"`
	Streams      int     `json:"streams"`
	Files        int     `json:"files"`
	RawBytes     int64   `json:"raw_bytes"`
	StoredBytes  int64   `json:"stored_bytes"`
	StreamBytes  int64   `json:"stream_bytes"`
	WireBytes    int64   `json:"wire_bytes"`
	WireRatio    float64 `json:"wire_ratio"`
	DowntimeSecs float64 `json:"downtime_seconds"`
	// DowntimeTo says where the downtime ends: "restored" (the receiver
	// reported the restored PID) or "dumped" (the receiver does not restore).
	DowntimeTo  string  `json:"downtime_to"`
	Phases      []phase `json:"phases"`
	TotalSecs   float64 `json:"total_seconds"`
	LeftRunning bool    `json:"left_running"`
	KeptImage   string  `json:"kept_image,omitempty"`
	// CUDA processes suspended for the dump, and their GPUs.
	CUDAPIDs []int          `json:"cuda_pids,omitempty"`
	GPUs     []manifest.GPU `json:"gpus,omitempty"`
}

func runMigrate(ctx context.Context, cfg *config, args []string) error {
	if len(args) > 0 {
		return usagef("migrate: unexpected arguments %q", args)
	}
	if cfg.pid <= 0 {
		return usagef("migrate needs --pid PID")
	}
	loc, err := location.Parse(cfg.to)
	if err != nil || loc.Kind != location.TCP {
		return usagef("migrate needs --to tcp://HOST:PORT (a receiver started with gpucr-stream receive)")
	}
	o, err := cfg.dialOptions(false)
	if err != nil {
		return err
	}
	lockTimeout, err := cfg.lockTimeoutDur()
	if err != nil {
		return err
	}
	criu, err := capture.FindCRIU(cfg.criu)
	if err != nil {
		return err
	}
	tree, err := proc.Tree(cfg.pid)
	if err != nil {
		return err
	}
	// The CUDA processes of the tree: their GPU state is moved into host
	// memory (lock, checkpoint) before CRIU dumps them, as for checkpoint.
	cc, err := findCUDA(cfg, cfg.pid)
	if err != nil {
		return fmt.Errorf("migrate %d: %w (the process was not touched)", cfg.pid, err)
	}
	start := time.Now()
	out, err := tcp.Dial(ctx, loc.Path, o)
	if err != nil {
		return fmt.Errorf("migrate %d: %w (the process was not touched)", cfg.pid, err)
	}
	defer out.Close()
	info := out.Receiver()
	res := migrateResult{PID: cfg.pid, Destination: redact.URL(cfg.to), Session: out.Session(), Streams: o.Streams, LeftRunning: cfg.leaveRunning}

	// Unless the process is left running, a copy of the image stays here
	// until the receiver confirms the restore: whatever happens there after
	// the source is killed, the process is not lost.
	var output streamer.Output = out
	var keep *os.File
	if !cfg.leaveRunning && cfg.keepDir != "none" {
		dir := cfg.keepDir
		if dir == "" {
			dir = os.TempDir()
		}
		keep, err = os.CreateTemp(dir, fmt.Sprintf("gpucr-migrate-%d-%s-*.stream", cfg.pid, out.Session()))
		if err != nil {
			out.Cancel("sender could not create its local copy")
			return fmt.Errorf("migrate %d: local copy of the image: %w (the process was not touched)", cfg.pid, err)
		}
		defer keep.Close()
		keepOut, err := streamer.NewStreamOutput([]io.Writer{keep})
		if err != nil {
			os.Remove(keep.Name())
			return err
		}
		output = streamer.TeeOutput{Primary: out, Copy: keepOut}
	}
	dropKeep := func() {
		if keep != nil {
			keep.Close()
			os.Remove(keep.Name())
			keep = nil
		}
	}

	c, err := streamer.NewCapture(ctx, output, cfg.opts)
	if err != nil {
		out.Cancel("sender failed to start")
		dropKeep()
		return err
	}
	out.OnFailure(func(err error) { c.Abort(err) })
	bar := startProgress(cfg, "migrate", &c.Counters, 0)
	meta := manifest.Manifest{Tool: "gpucr-stream " + version, CRIUVersion: capture.CRIUVersion(ctx, criu)}
	var m *manifest.Manifest
	var closed bool
	var rep capture.DumpReport
	phases := cc.queryGPUs(ctx, &meta)
	// The downtime starts with the GPU lock: CUDA work stops there.
	dumpStart := time.Now()
	ps, err := cc.suspend(lockTimeout)
	phases = append(phases, ps...)
	// A failed suspend has undone its steps, and CRIU does not run.
	if err == nil {
		rep, err = capture.Dump(ctx, capture.DumpOptions{
			CRIU: criu, PID: cfg.pid, WorkDir: cfg.workDir, LeaveRunning: cfg.leaveRunning, ExtraArgs: strings.Fields(cfg.criuOpts),
			BeforeKill: func(ctx context.Context, _ capture.DumpResult) error {
				// The commit point: the receiver holds the whole image, verified,
				// before CRIU kills the process; if not, CRIU resumes it.
				closed = true
				var err error
				m, err = c.Close(ctx, meta)
				return err
			},
		}, c)
		if err != nil {
			err = cc.undo(err)
		}
	}
	dumped := time.Now()
	bar.finish()
	if !closed {
		c.Abort(errors.New("checkpoint did not complete"))
		_, _ = c.Close(ctx, manifest.Manifest{})
	}
	if err != nil {
		out.Cancel("the checkpoint failed on the sender; the process keeps running there")
		dropKeep()
		return fmt.Errorf("migrate %d: %w; the process was not migrated and keeps running here", cfg.pid, err)
	}
	res.Phases = append(phases,
		phase{"criu dump + transfer", (rep.CRIU - rep.Commit).Seconds()},
		phase{"receiver verifies (commit)", rep.Commit.Seconds()})
	// With --leave-running the source runs on at once, GPU included; the
	// receiver restores its copy meanwhile.
	var gpuErr error
	if cfg.leaveRunning {
		ps, err := cc.resume()
		res.Phases = append(res.Phases, ps...)
		if err != nil {
			gpuErr = fmt.Errorf("resuming the GPU state of the source failed: %w (retry with `gpucr-stream gpu resume --pid %d`)", err, cfg.pid)
		}
	}
	if keep != nil {
		res.KeptImage = keep.Name()
		keep.Close()
	}
	res.Files, res.RawBytes, res.StoredBytes = len(m.Files), m.Stats.RawBytes, m.Stats.StoredBytes
	res.CUDAPIDs, res.GPUs = cc.cudaPIDs(), m.GPUs
	for _, n := range out.Sizes() {
		res.StreamBytes += n
	}
	lost := func(err error) error {
		res.WireBytes = out.WireBytes()
		switch {
		case cfg.leaveRunning && gpuErr != nil:
			return fmt.Errorf("migrate %d: %w; the source process is still here (--leave-running), but %w", cfg.pid, err, gpuErr)
		case cfg.leaveRunning:
			return fmt.Errorf("migrate %d: %w; the source process is still running here (--leave-running)", cfg.pid, err)
		case res.KeptImage != "":
			return fmt.Errorf("migrate %d: %w; the source process is gone, its image is kept at %s: restore it with `gpucr-stream restore --from %s`", cfg.pid, err, res.KeptImage, res.KeptImage)
		}
		return fmt.Errorf("migrate %d: %w; the source process is gone and no copy was kept (--keep-dir none)", cfg.pid, err)
	}
	if !cfg.leaveRunning {
		// Only now may the receiver start the process: CRIU has killed the
		// source, and where the receiver restores into this PID space (one
		// host, network namespaces) its PIDs must also be free, i.e. reaped.
		gone := time.Now()
		reaped := out.Acked().PIDSpace != "" && out.Acked().PIDSpace == proc.Space()
		if err := proc.WaitGone(ctx, tree, reaped, o.Timeout); err != nil {
			cfg.logLine(fmt.Sprintf("migrate: %v; telling the receiver to restore anyway", err))
		}
		res.Phases = append(res.Phases, phase{"source process gone", time.Since(gone).Seconds()})
	}
	if err := out.Confirm(ctx, tcp.CommitInfo{LeftRunning: cfg.leaveRunning, GPUs: m.GPUs}); err != nil {
		return lost(err)
	}
	if info.Restores {
		committed := time.Now()
		r, err := out.WaitReport(ctx)
		if err != nil {
			return lost(fmt.Errorf("%w (the receiver may have restored it: check there before using the copy)", err))
		}
		if r.Error != "" {
			return lost(fmt.Errorf("restore on the receiver failed: %s", r.Error))
		}
		res.RestoredPID = r.PID
		res.DowntimeSecs, res.DowntimeTo = time.Since(dumpStart).Seconds(), "restored"
		res.Phases = append(res.Phases, phase{"restore on the receiver", time.Since(committed).Seconds()})
		dropKeep()
		res.KeptImage = ""
	} else {
		// The receiver serves an external criu restore and cannot confirm
		// it; the copy stays (remove it once the process runs there).
		res.DowntimeSecs, res.DowntimeTo = dumped.Sub(dumpStart).Seconds(), "dumped"
	}
	res.WireBytes = out.WireBytes()
	if res.WireBytes > 0 {
		res.WireRatio = float64(res.RawBytes) / float64(res.WireBytes)
	}
	res.TotalSecs = time.Since(start).Seconds()
	if gpuErr != nil {
		return fmt.Errorf("migrate %d: the copy reached %s, but %w", cfg.pid, res.Destination, gpuErr)
	}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(res)
	}
	w := cfg.stdout
	if res.RestoredPID > 0 {
		fmt.Fprintf(w, "migrated process %d to %s: restored there as %d, downtime %.2fs\n", res.PID, res.Destination, res.RestoredPID, res.DowntimeSecs)
	} else {
		fmt.Fprintf(w, "migrated process %d to %s (served there to criu restore), dump took %.2fs\n", res.PID, res.Destination, res.DowntimeSecs)
	}
	for _, p := range res.Phases {
		fmt.Fprintf(w, "  %-30s %7.3fs\n", p.Name, p.Secs)
	}
	fmt.Fprintf(w, "  %d files, %s raw, %s on the wire (%.2fx) over %d stream(s)\n", res.Files, humanBytes(res.RawBytes), humanBytes(res.WireBytes), res.WireRatio, res.Streams)
	printGPUs(w, res.CUDAPIDs, res.GPUs)
	if res.KeptImage != "" {
		fmt.Fprintf(w, "  image kept at %s until you remove it\n", res.KeptImage)
	}
	return nil
}

// finishRestore ends receive --restore once CRIU has restored the tree of
// rep.PID (err: that, or what came before it, failed). The restored CUDA
// processes are still checkpointed, their device memory in host memory:
// it goes back onto the GPU and they run. The report for the sender names
// the PID only when both steps succeeded; otherwise the sender keeps its
// copy of the image and says so.
func finishRestore(cfg *config, rep capture.RestoreReport, err error, pairs []vram.GPUPair) (tcp.Report, []int, vram.Timings, error) {
	report := tcp.Report{Served: rep.Served}
	var cudaPIDs []int
	var t vram.Timings
	if err == nil {
		if cudaPIDs, t, err = cudaRestore(cfg, rep.PID, pairs); err != nil {
			err = fmt.Errorf("process %d restored, but its GPU state is not: %w", rep.PID, err)
		}
	}
	if err != nil {
		report.Error = err.Error()
		return report, nil, t, err
	}
	report.PID = rep.PID
	return report, cudaPIDs, t, nil
}
