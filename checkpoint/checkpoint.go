// Package checkpoint is what the commands do, as library calls: checkpoint
// a process tree into a location and restore it from one (Checkpoint,
// Restore), move it to another host (Migrate, Receive), and the
// criu-image-streamer flows that sit beside a CRIU run by someone else
// (Capture, Serve, Extract). Each takes an Options struct of parsed values
// and returns a Result with the timed phases; progress reaches the caller
// through Hooks. The GPU side around CRIU (the CUDA suspend/undo/resume
// policy, the GPU fast path for processes that run with libgpucr-preload)
// is package gpuckpt, which Checkpoint, Restore, Migrate and Receive call.
package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/gpuckpt"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/testhook"
)

// Phase is one timed step of a checkpoint or restore; the GPU steps
// (package gpuckpt) time theirs the same way.
type Phase = gpuckpt.Phase

// Progress describes work with live counters, for a progress bar.
type Progress struct {
	What     string
	Counters *pipeline.Counters
	// Total is the bytes the work will move when known (0: unknown).
	Total int64
	// Uploaded reports the bytes an object store acknowledged; nil where
	// there is no object store.
	Uploaded func() int64
	// Ahead reports the bytes (as stored) that a receiver got ahead of the
	// stream, in pre-copy rounds: Counters count them only once the final
	// dump refers to them. nil elsewhere.
	Ahead func() int64
}

// Hooks let the caller follow the work. Any may be nil.
type Hooks struct {
	// Progress is called when work with live counters starts; the func it
	// returns (may be nil) is called once when that work ends.
	Progress func(Progress) (done func())
	// Line takes the progress lines criu-image-streamer's users parse:
	// socket-init, checkpoint-start.
	Line func(string)
	// Stats takes the statistics line of capture, serve and extract when
	// criu-image-streamer writes it: capture's and extract's at the end,
	// serve's before it listens.
	Stats func(*Stats)
	// Log takes diagnostic lines.
	Log func(string)
}

// progress starts p; the returned func may be called more than once.
func (h Hooks) progress(p Progress) func() {
	if h.Progress == nil || p.Counters == nil {
		return func() {}
	}
	done := h.Progress(p)
	if done == nil {
		return func() {}
	}
	var once sync.Once
	return func() { once.Do(done) }
}

func (h Hooks) stats(st *Stats) {
	if h.Stats != nil {
		h.Stats(st)
	}
}

// openSource opens a source and starts its progress (what: "restore",
// "extract"); the caller defers the source's Close and done.
func (h Hooks) openSource(ctx context.Context, what string, loc location.Location, open location.Config,
	so source.StreamSourceOptions) (src source.Source, done func(), err error) {
	if so.Log == nil {
		so.Log = h.Log
	}
	if src, err = location.OpenSource(ctx, loc, open, so); err != nil {
		return nil, nil, err
	}
	counters, total := location.SourceCounters(src)
	return src, h.progress(Progress{What: what, Counters: counters, Total: total}), nil
}

func (h Hooks) line(s string) {
	if h.Line != nil {
		h.Line(s)
	}
}

func (h Hooks) log(s string) {
	if h.Log != nil {
		h.Log(s)
	}
}

// CRIU is how CRIU runs.
type CRIU struct {
	// Path is the criu binary (empty: criu on PATH, then
	// /opt/gpucr-criu/bin/criu).
	Path string
	// WorkDir holds CRIU's images dir, sockets and logs (empty: a new
	// temporary dir).
	WorkDir string
	// Args are extra criu arguments.
	Args []string
	// Carry names files of CRIU's images dir to carry in the checkpoint
	// and write back there on restore (criusock/carry.go).
	Carry []string
	// Launcher runs CRIU through a container runtime (package container);
	// nil: criu runs here.
	Launcher criusock.Launcher
}

// Options are a checkpoint's.
type Options struct {
	// PID is the root of the process tree.
	PID  int
	Dest location.Location
	Open location.Config
	CRIU CRIU
	// LeaveRunning keeps the process running after the checkpoint.
	LeaveRunning bool
	// Producers is the number of VRAM producers the image waits for.
	Producers int
	CUDA      gpuckpt.CUDA
	// FastPath moves the device memory of CUDA processes that run with
	// libgpucr-preload through the pipeline (package gpuckpt).
	FastPath gpuckpt.FastPath
	// Tool is recorded in the manifest ("gpucr-stream VERSION").
	Tool  string
	Hooks Hooks
}

// Result is a committed checkpoint.
type Result struct {
	PID         int     `json:"pid"`
	Destination string  `json:"destination"`
	Files       int     `json:"files"`
	RawBytes    int64   `json:"raw_bytes"`
	StoredBytes int64   `json:"stored_bytes"`
	Ratio       float64 `json:"ratio"`
	Phases      []Phase `json:"phases"`
	TotalSecs   float64 `json:"total_seconds"`
	LeftRunning bool    `json:"left_running"`
	// CUDA processes suspended for the dump, and their GPUs.
	CUDAPIDs  []int          `json:"cuda_pids,omitempty"`
	GPUs      []manifest.GPU `json:"gpus,omitempty"`
	Producers int            `json:"producers,omitempty"`
	// VRAM is what the GPU fast path did with their device memory.
	VRAM *gpuckpt.VRAMSummary `json:"vram,omitempty"`
}

// GoneTimeout is how long Checkpoint waits for the dumped tree to die, and
// Restore for the checkpointed PIDs to be free.
var GoneTimeout = 10 * time.Second

// Checkpoint dumps the tree of o.PID with CRIU into o.Dest. The manifest is
// committed before CRIU kills the process; if anything fails before, the
// process (and its GPU state) runs on.
func Checkpoint(ctx context.Context, o Options) (*Result, error) {
	if o.PID <= 0 || !proc.Exists(o.PID) {
		return nil, fmt.Errorf("checkpoint: no process %d: %w", o.PID, errdefs.ErrNotFound)
	}
	criu, err := criusock.FindCRIU(o.CRIU.Path)
	if err != nil {
		return nil, err
	}
	// CRIU's version (the manifest's, and a runtime's swrk's) is asked
	// while the checks run and the destination opens.
	version := criusock.StartVersionQuery(ctx, criu)
	defer version.Wait()
	// The CUDA processes of the tree: their GPU state is moved into host
	// memory (lock, checkpoint) before CRIU dumps them.
	cc, err := gpuckpt.Find(o.CUDA, o.PID)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %d: %w", o.PID, err)
	}
	// nvidia-smi answers while the checks run and the destination opens.
	cc.StartGPUQuery(ctx)
	defer cc.GPUs(ctx) // waits for the query on every path
	// The tree as it is before the dump, to wait for it to be gone after.
	tree, _ := proc.Tree(o.PID)
	if err := cc.CheckDumpable(ctx, tree, o.CRIU.Args, fastIf(o.FastPath, gpuckpt.FastCarried(o.Dest))); err != nil {
		return nil, fmt.Errorf("checkpoint %d: %w (the process was not touched)", o.PID, err)
	}
	if o.CRIU.Args, err = dumpNetworkLock(ctx, criu, o.CRIU.Args, tree); err != nil {
		return nil, fmt.Errorf("checkpoint %d: %w (the process was not touched)", o.PID, err)
	}
	o.CRIU.Args = dumpGhostLimit(o.CRIU.Args, tree, o.Hooks.log)
	start := time.Now()
	c, out, err := location.StartCapture(ctx, o.Dest, o.Open)
	if err != nil {
		return nil, err
	}
	meta := manifest.Manifest{Tool: o.Tool, Process: processOf(o.PID)} // CRIUVersion: dump's
	phases := []Phase{{Name: "open destination", Secs: time.Since(start).Seconds()}}
	phases = append(phases, cc.QueryGPUs(ctx, &meta)...)
	done := o.Hooks.progress(Progress{What: "checkpoint", Counters: &c.Counters, Uploaded: out.Uploaded,
		Total: dumpEstimate(tree, meta.GPUs)})
	defer done()
	// The fast path first (the processes' device memory into the capture,
	// then released), so that the driver's checkpoint finds little to copy;
	// with --dedup it copies what changed since an earlier checkpoint.
	fp := o.FastPath
	if o.Open.Options.Dedup {
		fp.Dedup = &gpuckpt.DedupTarget{Dest: o.Dest, Open: o.Open}
	}
	ps, err := cc.FastSuspend(ctx, fp, gpuckpt.FastCarried(o.Dest), c, &meta, o.Hooks.log)
	phases = append(phases, ps...)
	if err == nil {
		ps, err = cc.Suspend(ctx, o.CUDA.LockTimeout)
		phases = append(phases, ps...)
	}
	if err != nil {
		// fastSuspend and suspend have undone their steps: the process
		// runs on.
		location.AbortCapture(ctx, c, err)
		return nil, fmt.Errorf("checkpoint %d: %w", o.PID, err)
	}
	m, rep, err := dump(ctx, c, meta, criusock.DumpOptions{
		CRIU: criu, PID: o.PID, WorkDir: o.CRIU.WorkDir, LeaveRunning: o.LeaveRunning,
		ExtraArgs: o.CRIU.Args, Producers: o.Producers, Hooks: criusock.Hooks{Log: o.Hooks.Log},
		Carry: o.CRIU.Carry, Launcher: o.CRIU.Launcher, Version: version,
	}, cc)
	done()
	if err != nil {
		return nil, fmt.Errorf("checkpoint %d: %w", o.PID, cc.Undo(err))
	}
	phases = append(phases, cc.FastStorePhases()...)
	phases = append(phases, Phase{Name: "criu dump + encode + write", Secs: (rep.CRIU - rep.Commit).Seconds()}, Phase{Name: "commit", Secs: rep.Commit.Seconds()})
	if o.LeaveRunning {
		ps, rerr := cc.Resume()
		phases = append(phases, ps...)
		if rerr != nil {
			return nil, fmt.Errorf("checkpoint %d committed to %s, but resuming its GPU state failed: %w", o.PID, o.Dest, rerr)
		}
	} else {
		// The kept copy goes while CRIU's kill is reaped (both only wait).
		removed := make(chan struct{})
		go func() {
			defer close(removed)
			cc.FastCommit()
		}()
		// Return once CRIU's kill took: the process has let go of its
		// memory and its GPU. Its parent reaps it in its own time (a
		// restored process's parent is PID 1, which on some hosts reaps
		// a second or more later); a restore right after waits for that
		// (waitReaped). The checkpoint is committed either way.
		exit := time.Now()
		if err := proc.WaitGone(ctx, tree, false, GoneTimeout); err != nil {
			o.Hooks.log(fmt.Sprintf("checkpoint %d committed, but the process is still alive (%v)", o.PID, err))
		}
		<-removed
		phases = append(phases, Phase{Name: "process exit", Secs: time.Since(exit).Seconds()})
	}
	return &Result{PID: o.PID, Destination: o.Dest.String(), Files: len(m.Files), RawBytes: m.Stats.RawBytes,
		StoredBytes: m.Stats.StoredBytes, Ratio: m.Stats.Ratio(), LeftRunning: o.LeaveRunning,
		Phases: phases, TotalSecs: time.Since(start).Seconds(), CUDAPIDs: cc.PIDs(), GPUs: m.GPUs, Producers: rep.Producers, VRAM: cc.VRAM()}, nil
}

// dump runs CRIU into c and commits c, with meta, at CRIU's commit point:
// the image is durable (or the receiver holds it, verified) before CRIU
// kills the process; if the commit fails, CRIU resumes it. A dump that
// never reached the commit point aborts c.
//
// The fast path's store (cc's, nil-safe) writes into c beside CRIU: the
// commit waits for it, and fails with it; an abort stops it and waits for
// it before closing c (Close wants every WriteFile returned).
func dump(ctx context.Context, c *streamer.Capture, meta manifest.Manifest, o criusock.DumpOptions, cc *gpuckpt.Checkpoint) (*manifest.Manifest, criusock.DumpReport, error) {
	var m *manifest.Manifest
	var closed bool
	var storeErr error
	o.BeforeKill = func(ctx context.Context, _ criusock.DumpResult) error {
		if err := testhook.Pause(ctx, "post-dump"); err != nil {
			return err
		}
		if storeErr = cc.FastWait(ctx); storeErr != nil {
			return storeErr
		}
		closed = true
		if o.Version != nil {
			meta.CRIUVersion = o.Version.String()
		}
		var err error
		m, err = c.Close(ctx, meta)
		return err
	}
	rep, err := criusock.Dump(ctx, o, c)
	if !closed {
		cause := errors.New("checkpoint did not complete")
		c.Abort(cause)
		if serr := cc.FastWait(ctx); serr != nil && storeErr == nil && err != nil {
			// A failed store aborted c: say so, not only CRIU's end.
			err = fmt.Errorf("%w (%w)", err, serr)
		}
		location.AbortCapture(ctx, c, cause)
	}
	return m, rep, err
}

// RestoreOptions are a restore's.
type RestoreOptions struct {
	Src       location.Location
	Open      location.Config
	CRIU      CRIU
	Producers int
	CUDA      gpuckpt.CUDA
	GPUMap    gpuckpt.GPUMap
	Hooks     Hooks
}

// RestoreResult is a restored process tree.
type RestoreResult struct {
	PID    int    `json:"pid"`
	Source string `json:"source"`
	Files  int    `json:"files"`
	Bytes  int64  `json:"bytes"`
	// SparseBytes are the zero pages CRIU was not handed: restored as
	// memory never touched (criusock/sparse.go).
	SparseBytes int64   `json:"sparse_bytes,omitempty"`
	Phases      []Phase `json:"phases"`
	TotalSecs   float64 `json:"total_seconds"`
	// CUDA processes brought back onto the GPU.
	CUDAPIDs  []int `json:"cuda_pids,omitempty"`
	Producers int   `json:"producers,omitempty"`
}

// Restore restores a checkpoint with CRIU, then brings its CUDA processes
// back onto the GPU.
func Restore(ctx context.Context, o RestoreOptions) (*RestoreResult, error) {
	criu, err := criusock.FindCRIU(o.CRIU.Path)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	// From a stream, CRIU restores while it is read (see serveEarly).
	src, done, err := o.Hooks.openSource(ctx, "restore", o.Src, o.Open, source.StreamSourceOptions{ServeEarly: true})
	if err != nil {
		return nil, fmt.Errorf("restore: %w", err)
	}
	defer src.Close()
	defer done()
	var recorded []manifest.GPU
	var stage *gpuckpt.Stage
	// The driver is loaded and initialised while CRIU restores, unless the
	// checkpoint says it holds no CUDA process (a stream says nothing).
	warmDriver := o.CUDA.EffectiveMode() != gpuckpt.CUDAOff
	if m := source.ManifestOf(src); m != nil {
		recorded = m.GPUs
		warmDriver = warmDriver && len(m.CUDA) > 0
		// The fast path's VRAM files are read into memory while CRIU
		// restores (gpuckpt/stage.go).
		if o.CUDA.EffectiveMode() != gpuckpt.CUDAOff {
			if stage, err = gpuckpt.StartStage(ctx, src, m.CUDA, o.CUDA.Stage); err != nil {
				return nil, err
			}
			defer stage.Close()
		}
	}
	pairs, err := o.GPUMap.For(recorded)
	if err == nil {
		err = o.CUDA.CheckMap(ctx, pairs, recorded)
	}
	if err != nil {
		return nil, err
	}
	// And filled into the device while CRIU restores (gpuckpt/fill.go).
	var fill *gpuckpt.Fill
	if m := source.ManifestOf(src); m != nil && o.CUDA.EffectiveMode() != gpuckpt.CUDAOff {
		fill = gpuckpt.StartFill(ctx, src, stage, m.CUDA, m.GPUs, pairs)
		defer fill.Close()
	}
	opened := time.Since(start).Seconds()
	var warm sync.WaitGroup
	var warmed time.Duration
	if warmDriver {
		warm.Go(func() {
			t := time.Now()
			o.CUDA.Warm()
			warmed = time.Since(t)
		})
	}
	defer warm.Wait()
	// The driver warms while a slow parent reaps the checkpointed tree
	// (CRIU waits for its PIDs: criusock.Restore).
	buffering := o.Open.StreamSourceOptions(source.StreamSourceOptions{})
	rep, err := criusock.Restore(ctx, criusock.CRIURestoreOptions{CRIU: criu, WorkDir: o.CRIU.WorkDir,
		ExtraArgs: restoreNetworkLock(ctx, criu, o.CRIU.Args), Producers: o.Producers, Hooks: criusock.Hooks{Log: o.Hooks.Log},
		FreePIDs: GoneTimeout, MemoryLimit: buffering.MemoryLimit, SpillDir: buffering.SpillDir, Carry: o.CRIU.Carry, Launcher: o.CRIU.Launcher}, src)
	if err == nil {
		err = streamEnded(ctx, src, rep.PID)
	}
	done()
	if err != nil {
		return nil, fmt.Errorf("restore from %s: %w", o.Src, err)
	}
	phases := []Phase{{Name: "open source", Secs: opened}}
	if rep.PIDWait > 0 {
		phases = append(phases, Phase{Name: "wait for the checkpointed PIDs to be reaped", Secs: rep.PIDWait.Seconds()})
	}
	phases = append(phases, Phase{Name: "criu restore + read + decode", Secs: (rep.CRIU - rep.PIDWait).Seconds()})
	// The restored CUDA processes are still checkpointed: their device
	// memory is in host memory. Put it back on the GPU and let them run.
	warm.Wait()
	t0 := time.Now()
	cudaPIDs, t, err := gpuckpt.Restore(ctx, o.CUDA, rep.PID, pairs)
	if warmDriver && len(cudaPIDs) > 0 {
		phases = append(phases, Phase{Name: "gpu driver init (beside criu)", Secs: warmed.Seconds()})
	}
	if len(cudaPIDs) > 0 {
		phases = append(phases, Phase{Name: "gpu find (processes, driver)", Secs: (time.Since(t0) - t.Restore - t.Unlock).Seconds()})
	}
	phases = append(phases, gpuckpt.TimingPhases(t)...)
	if err != nil {
		return nil, fmt.Errorf("restore from %s: process %d restored, but its GPU state is not: %w", o.Src, rep.PID, err)
	}
	// Those that took the fast path wait, parked, for their memory.
	if o.CUDA.EffectiveMode() != gpuckpt.CUDAOff {
		procs, err := gpuckpt.FastProcs(ctx, src)
		if err == nil {
			var ps []Phase
			ps, err = gpuckpt.FastRestore(ctx, src, stage, fill, procs, cudaPIDs)
			phases = append(phases, ps...)
		}
		if err != nil {
			return nil, fmt.Errorf("restore from %s: process %d restored, but its device memory is not: %w", o.Src, rep.PID, err)
		}
	}
	return &RestoreResult{PID: rep.PID, Source: o.Src.String(), Files: rep.Served, Bytes: rep.Bytes, SparseBytes: rep.Sparse,
		Phases: phases, TotalSecs: time.Since(start).Seconds(), CUDAPIDs: cudaPIDs, Producers: rep.Producers}, nil
}

// fastIf is f, or the fast path off where what restores the checkpoint
// would not bring the VRAM files back (the fast path is not taken then).
func fastIf(f gpuckpt.FastPath, carried bool) gpuckpt.FastPath {
	if !carried {
		f.Mode = gpuckpt.FastPathOff
	}
	return f
}

// streamEnded waits for the end of a stream CRIU restored pid from while
// it was read: CRIU got only files that were whole and checked, but a
// stream damaged after them is a damaged checkpoint, and what CRIU
// restored from it is killed.
func streamEnded(ctx context.Context, src source.Source, pid int) error {
	stream := location.StreamOf(src)
	if stream == nil {
		return nil
	}
	err := stream.Wait(ctx)
	if err == nil || pid <= 0 {
		return err
	}
	if kerr := proc.KillTree(pid); kerr != nil {
		return fmt.Errorf("the stream failed after criu restored process %d: %w; killing its tree failed: %v", pid, err, kerr)
	}
	return fmt.Errorf("the stream failed after criu restored process %d, its tree killed: %w", pid, err)
}

// processOf describes the process being checkpointed, for ls and inspect.
func processOf(pid int) *manifest.Process {
	p := &manifest.Process{PID: pid}
	p.Cmdline, _ = proc.Cmdline(pid)
	return p
}

// dumpEstimate is about the raw bytes a dump of tree will produce: its
// anonymous memory, and the device memory of its GPUs, which the CUDA
// checkpoint moves into host memory before CRIU reads it.
func dumpEstimate(tree []int, gpus []manifest.GPU) int64 {
	n := proc.DumpEstimate(tree)
	for _, g := range gpus {
		n += g.Bytes
	}
	return n
}
