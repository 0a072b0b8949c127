package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/gpuckpt"
	"github.com/gpucr/gpucr-stream/knobs"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/transport/tcp"
)

// ReceiveOptions are a receiver's.
type ReceiveOptions struct {
	// Listen is HOST:PORT to accept one checkpoint on.
	Listen string
	TCP    location.TCPConfig
	// Stream are the options of the held stream (memory, spill dir).
	Stream source.StreamSourceOptions
	// Restore restores the checkpoint with CRIU; otherwise it is served
	// to an external `criu restore --stream -D ImagesDir`.
	Restore bool
	// LazyPages restores with CRIU's lazy pages once the whole image is
	// in (criusock.RestoreLazy); trees with CUDA processes are restored
	// from the stream as without it.
	LazyPages bool
	ImagesDir string
	CRIU      CRIU
	CUDA      gpuckpt.CUDA
	// GPUMap resolves against the GPUs the sender records.
	GPUMap gpuckpt.GPUMap
	Hooks  Hooks
}

// ReceiveResult is what a receiver took and did.
type ReceiveResult struct {
	PID         int     `json:"pid,omitempty"`
	Listen      string  `json:"listen"`
	Peer        string  `json:"peer,omitempty"`
	Session     string  `json:"session,omitempty"`
	Streams     int     `json:"streams,omitempty"`
	Files       int     `json:"files"`
	RawBytes    int64   `json:"raw_bytes"`
	StreamBytes int64   `json:"stream_bytes"`
	WireBytes   int64   `json:"wire_bytes"`
	Phases      []Phase `json:"phases"`
	TotalSecs   float64 `json:"total_seconds"`
	LeftRunning bool    `json:"source_left_running,omitempty"`
	// CUDA processes brought back onto the GPU.
	CUDAPIDs []int `json:"cuda_pids,omitempty"`
	// CRIUWaitedSecs is how long CRIU's first request waited for the
	// sender's commit: the part of its start that overlapped the transfer.
	CRIUWaitedSecs float64 `json:"criu_waited_seconds,omitempty"`
	// CachedChunks and CachedBytes are what the sender's pre-copy rounds
	// sent ahead (the chunk cache, freed once the stream was read).
	CachedChunks int   `json:"cached_chunks,omitempty"`
	CachedBytes  int64 `json:"cached_bytes,omitempty"`
	// LazyPages: restored with lazy pages; the process ran RunningSecs
	// before the last page was in.
	LazyPages   bool    `json:"lazy_pages,omitempty"`
	RunningSecs float64 `json:"running_seconds,omitempty"`
	// Stats is the statistics line of a served (not restored) checkpoint.
	Stats *Stats `json:"-"`
}

// receiver is one Receive in progress.
type receiver struct {
	o    ReceiveOptions
	criu string
	src  *tcp.Source
	// stopSource ends the transfer: the sender is refused with the cause.
	stopSource context.CancelCauseFunc
	start      time.Time
	res        ReceiveResult
}

// Receive accepts one checkpoint on o.Listen, then restores it (o.Restore)
// or serves it to CRIU; either way the sender hears how it went.
func Receive(ctx context.Context, o ReceiveOptions) (*ReceiveResult, error) {
	r := &receiver{o: o}
	if o.Restore {
		var err error
		if r.criu, err = criusock.FindCRIU(o.CRIU.Path); err != nil {
			return nil, err
		}
		// A map onto a GPU this host lacks fails now, before a sender
		// stops its process for nothing.
		if err = o.CUDA.CheckMap(ctx, o.GPUMap.Targets(), nil); err != nil {
			return nil, fmt.Errorf("receive: %w", err)
		}
		if o.LazyPages {
			if err = criusock.CheckLazyPages(ctx, r.criu); err != nil {
				return nil, fmt.Errorf("receive --lazy-pages: %w (restore without --lazy-pages)", err)
			}
		}
		o.CUDA.Warm() // not in the downtime
	}
	r.start = time.Now()
	l, err := tcp.Listen(ctx, o.Listen, tcp.ListenOptions{Auth: o.TCP.Auth, Timeout: o.TCP.Timeout, Reports: true, Restores: o.Restore,
		PIDSpace: proc.Space(), Log: o.Hooks.Log, ChunkCache: true, CacheMemory: cacheMemory(o.Stream), SpillDir: o.Stream.SpillDir})
	if err != nil {
		return nil, err
	}
	sctx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	r.stopSource = stop
	r.src = tcp.NewSource(sctx, l, o.Stream)
	defer r.src.Close()
	o.Hooks.log("receive: listening on " + l.Addr().String())
	r.res.Listen = l.Addr().String()
	defer r.progress()()
	if o.Restore {
		err = r.restore(ctx)
	} else {
		err = r.serve(ctx)
	}
	if err != nil {
		return nil, fmt.Errorf("receive: %w", err)
	}
	r.res.TotalSecs = time.Since(r.start).Seconds()
	return &r.res, nil
}

// cacheMemory is the memory of the pre-copy chunk cache: as much as the
// held image may take before it spills (the cache spills beyond it too).
func cacheMemory(so source.StreamSourceOptions) int64 {
	if so.MemoryLimit > 0 {
		return so.MemoryLimit
	}
	return pipeline.DefaultMemoryLimit
}

// progress reports the stream's counters from when a sender connects
// (they exist only then) until the returned func is called.
func (r *receiver) progress() (stop func()) {
	quit := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			if c := r.src.Counters(); c != nil {
				done := r.o.Hooks.progress(Progress{What: "receive", Counters: c, Ahead: r.src.Session().AheadBytes})
				<-quit
				done()
				return
			}
			select {
			case <-quit:
				return
			case <-t.C:
			}
		}
	}()
	return func() {
		close(quit)
		wg.Wait()
	}
}

// fill takes the session's numbers and milestones into the result.
func (r *receiver) fill() {
	s := r.src.Session()
	if s == nil {
		return
	}
	res, src := &r.res, r.src
	res.Peer, res.Session, res.Streams = s.Peer, s.ID, s.Streams()
	res.StreamBytes, res.WireBytes = s.StreamBytes(), s.WireBytes()
	res.CachedChunks, res.CachedBytes = s.CacheChunks, s.CacheBytes
	if c := src.Counters(); c != nil {
		res.Files, res.RawBytes = int(c.Files.Load()), c.RawBytes.Load()
	}
	res.Phases = []Phase{{Name: "wait for the sender", Secs: src.Accepted.Sub(r.start).Seconds()}}
	if !src.Verified.IsZero() {
		res.Phases = append(res.Phases, Phase{Name: "receive + verify", Secs: src.Verified.Sub(src.Accepted).Seconds()})
	}
	if !src.Committed.IsZero() {
		res.Phases = append(res.Phases, Phase{Name: "sender commits (source gone)", Secs: src.Committed.Sub(src.Verified).Seconds()})
	}
}

// report tells the sender how it went; a sender that cannot hear it keeps
// its copy.
func (r *receiver) report(rep tcp.Report) {
	if err := r.src.Report(rep); err != nil {
		r.o.Hooks.log(fmt.Sprintf("receive: could not report to the sender: %v", err))
	}
}

// restore restores the checkpoint. CRIU starts as soon as a sender is
// accepted, beside the transfer: its start (65-130 ms to its first request
// on the 2-vCPU machine) overlaps the stream, and its first request waits,
// as every later one, behind a gate that opens once the sender has
// committed (its source is gone) and the GPUs it names are checked.
// CRIU's dump writes inventory.img, which the restore asks for first, last
// of all, so no earlier start is possible; nothing of the image reaches
// CRIU before the gate opens, so a transfer that breaks, a sender that
// never commits or a GPU map that fails leaves nothing restored. A CRIU
// that fails before the commit ends the transfer (the sender is refused and
// resumes its process).
func (r *receiver) restore(ctx context.Context) error {
	r.o.Hooks.line("socket-init")
	select {
	case <-r.src.Started():
	case <-r.src.Done():
	case <-ctx.Done():
		return context.Cause(ctx)
	}
	if r.src.Session() == nil {
		_, err := r.src.WaitCommitted(ctx) // no sender: its error
		return err
	}
	if r.o.LazyPages {
		ci, err := r.src.WaitCommitted(ctx)
		if err != nil {
			return err // nothing was restored: the sender is not told
		}
		if (len(ci.GPUs) == 0 && len(ci.CUDA) == 0) || lazyCUDA {
			return r.restoreLazy(ctx, ci)
		}
		r.o.Hooks.log("receive: lazy pages are not for CUDA processes: restoring from the stream")
	}
	gate := &commitGate{Source: r.src, open: make(chan struct{})}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var rep criusock.RestoreReport
	var err error
	criuDone := make(chan struct{})
	go func() {
		defer close(criuDone)
		rep, err = criusock.Restore(cctx, r.restoreOptions(cctx), gate)
		if err != nil {
			err = fmt.Errorf("restore: %w", err)
		}
	}()
	select {
	case <-r.src.Done():
	case <-criuDone:
		// CRIU ended without a byte of the image: the sender must not
		// kill its process for a receiver that cannot restore it.
		r.stopSource(fmt.Errorf("the receiver's criu failed before the transfer ended: %w", err))
		<-r.src.Done()
		if _, cerr := r.src.WaitCommitted(ctx); cerr == nil {
			break // committed just before: report the failure below
		}
		return err
	}
	ci, cerr := r.src.WaitCommitted(ctx)
	var pairs []cudadriver.GPUPair
	if cerr == nil {
		r.res.LeftRunning = ci.LeftRunning
		pairs, cerr = r.gpuPairs(ctx, ci)
	}
	rstart := gate.release(cerr)
	<-criuDone
	if _, commitErr := r.src.WaitCommitted(ctx); commitErr != nil {
		return commitErr // nothing was restored: the sender is not told
	}
	if cerr != nil {
		err = cerr
	}
	criuSecs := time.Since(rstart).Seconds()
	report, cudaPIDs, t, err := finishRestore(ctx, r.o.CUDA, rep, err, pairs)
	var fast []Phase
	if err == nil {
		if fast, err = r.deviceMemory(ctx, rep.PID, ci, cudaPIDs); err != nil {
			err = fmt.Errorf("%w; %s", err, killRestored(rep.PID))
			report = tcp.Report{Served: rep.Served, Error: err.Error()}
		}
	}
	report.RestoreSecs = time.Since(rstart).Seconds()
	r.report(report)
	if err != nil {
		return err
	}
	r.fill()
	r.res.PID, r.res.CUDAPIDs = rep.PID, cudaPIDs
	r.res.CRIUWaitedSecs = gate.waited(rstart).Seconds()
	r.res.Phases = append(r.res.Phases, Phase{Name: "criu restore", Secs: criuSecs})
	r.res.Phases = append(r.res.Phases, gpuckpt.TimingPhases(t)...)
	r.res.Phases = append(r.res.Phases, fast...)
	return nil
}

// restoreOptions are how CRIU restores here, from the stream or lazily.
func (r *receiver) restoreOptions(ctx context.Context) criusock.CRIURestoreOptions {
	return criusock.CRIURestoreOptions{CRIU: r.criu, WorkDir: r.o.CRIU.WorkDir,
		ExtraArgs: restoreNetworkLock(ctx, r.criu, r.o.CRIU.Args), Hooks: criusock.Hooks{Log: r.o.Hooks.Log}, FreePIDs: GoneTimeout,
		MemoryLimit: cacheMemory(r.o.Stream), SpillDir: r.o.Stream.SpillDir, Carry: r.o.CRIU.Carry, Launcher: r.o.CRIU.Launcher}
}

// gpuPairs maps the committed image's GPUs onto this host's (--gpu-map)
// and checks that they can take it.
func (r *receiver) gpuPairs(ctx context.Context, ci tcp.CommitInfo) ([]cudadriver.GPUPair, error) {
	pairs, err := r.o.GPUMap.For(ci.GPUs)
	if err == nil {
		err = r.o.CUDA.CheckMap(ctx, pairs, ci.GPUs)
	}
	return pairs, err
}

// deviceMemory brings back the device memory of the restored processes
// that took the fast path (parked, they wait for it); pid names the tree
// in the error.
func (r *receiver) deviceMemory(ctx context.Context, pid int, ci tcp.CommitInfo, cudaPIDs []int) ([]Phase, error) {
	if r.o.CUDA.EffectiveMode() == gpuckpt.CUDAOff {
		return nil, nil
	}
	fast, err := gpuckpt.FastRestore(ctx, r.src, nil, nil, ci.CUDA, cudaPIDs)
	if err != nil {
		return nil, fmt.Errorf("process %d restored, but its device memory is not: %w", pid, err)
	}
	return fast, nil
}

// lazyCUDA lets CUDA processes take lazy pages too (GPUCR_LAZY_CUDA=1):
// an experiment. It works, and does not pay on the GPU machine (the
// driver's restore waits on the pages it reads: docs/MIGRATION.md).
var lazyCUDA = knobs.LazyCUDA.On()

// restoreLazy restores the committed image with lazy pages: the process
// runs before its private memory is back, which CRIU's daemon then hands
// in. The sender hears of it once the last page is in, so that it keeps
// its copy until this side holds the whole process, and with how long the
// process had run by then: its downtime ended there. CUDA processes
// (lazyCUDA) come back onto the GPU meanwhile, as after a restore from the
// stream.
func (r *receiver) restoreLazy(ctx context.Context, ci tcp.CommitInfo) error {
	r.res.LeftRunning = ci.LeftRunning
	start := time.Now()
	pairs, err := r.gpuPairs(ctx, ci)
	var l *criusock.LazyRestore
	if err == nil {
		l, err = criusock.RestoreLazy(ctx, r.restoreOptions(ctx), r.src)
	}
	var cudaPIDs []int
	var t gpuckpt.DriverTimings
	var fast []Phase
	if err == nil {
		// CUDA processes come back onto the GPU while the daemon hands
		// their host memory in: the driver's restore faults in what it
		// reads of it.
		if _, cudaPIDs, t, err = finishRestore(ctx, r.o.CUDA, criusock.RestoreReport{PID: l.PID}, nil, pairs); err == nil {
			fast, err = r.deviceMemory(ctx, l.PID, ci, cudaPIDs)
		}
		if err != nil {
			err = fmt.Errorf("%w; %s", err, killRestored(l.PID))
			l.Abort()
		}
	}
	if err == nil {
		running := time.Now()
		if err = l.Wait(ctx); err == nil {
			r.res.RunningSecs = time.Since(running).Seconds()
		}
	}
	report := tcp.Report{RestoreSecs: time.Since(start).Seconds(), RunningSecs: r.res.RunningSecs}
	if l != nil {
		report.Served = l.Files
	}
	if err != nil {
		err = fmt.Errorf("restore: %w", err)
		report.Error = err.Error()
		r.report(report)
		return err
	}
	report.PID = l.PID
	r.report(report)
	r.fill()
	r.res.PID, r.res.CUDAPIDs, r.res.LazyPages = l.PID, cudaPIDs, true
	r.res.Phases = append(r.res.Phases, Phase{Name: "images written for lazy pages", Secs: l.Extract.Seconds()},
		Phase{Name: "criu restore --lazy-pages", Secs: l.CRIU.Seconds()})
	r.res.Phases = append(r.res.Phases, gpuckpt.TimingPhases(t)...)
	r.res.Phases = append(r.res.Phases, fast...)
	r.res.Phases = append(r.res.Phases, Phase{Name: "pages handed in while the process ran", Secs: r.res.RunningSecs})
	return nil
}

// commitGate holds CRIU's requests until release: then they go through to
// the source, or fail with release's error.
type commitGate struct {
	source.Source
	open  chan struct{}
	err   error
	mu    sync.Mutex
	first time.Time // CRIU's first request
}

func (g *commitGate) wait(ctx context.Context) error {
	g.mu.Lock()
	if g.first.IsZero() {
		g.first = time.Now()
	}
	g.mu.Unlock()
	select {
	case <-g.open:
		return g.err
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// release opens the gate (err: to fail every request) and returns when.
func (g *commitGate) release(err error) time.Time {
	g.err = err
	close(g.open)
	return time.Now()
}

// waited is how long CRIU's first request waited for the gate opened at
// open (zero if it came after).
func (g *commitGate) waited(open time.Time) time.Duration {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.first.IsZero() || g.first.After(open) {
		return 0
	}
	return open.Sub(g.first)
}

func (g *commitGate) Stat(ctx context.Context, name string) (manifest.File, error) {
	if err := g.wait(ctx); err != nil {
		return manifest.File{}, err
	}
	return g.Source.Stat(ctx, name)
}

func (g *commitGate) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	if err := g.wait(ctx); err != nil {
		return 0, err
	}
	return g.Source.Copy(ctx, name, w)
}

func (g *commitGate) Files(ctx context.Context) ([]manifest.File, error) {
	if err := g.wait(ctx); err != nil {
		return nil, err
	}
	return g.Source.Files(ctx)
}

// Manifest forwards what it wraps (source.Manifester).
func (g *commitGate) Manifest() *manifest.Manifest { return source.ManifestOf(g.Source) }

// killRestored kills the tree of a restored process whose device memory
// could not be brought back: parked, it could never run on, and the
// sender (told the restore failed) keeps the image to restore it from.
func killRestored(pid int) string {
	if err := proc.KillTree(pid); err != nil {
		return fmt.Sprintf("killing it here failed (%v): kill it before restoring the sender's copy", err)
	}
	return "it was killed here"
}

// serve serves the checkpoint to an external `criu restore --stream`; a
// transfer that breaks must end the wait for it too.
func (r *receiver) serve(ctx context.Context) error {
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var watch sync.WaitGroup
	watch.Add(1)
	go func() {
		defer watch.Done()
		select {
		case <-r.src.Done():
			if _, err := r.src.WaitCommitted(sctx); err != nil {
				cancel(err)
			}
		case <-sctx.Done():
		}
	}()
	sres, err := criusock.ServeWith(sctx, r.o.ImagesDir, r.src, criusock.ServeOptions{
		Hooks:       criusock.Hooks{Listening: func() { r.o.Hooks.line("socket-init") }, Log: r.o.Hooks.Log},
		MemoryLimit: cacheMemory(r.o.Stream), SpillDir: r.o.Stream.SpillDir})
	if cause := context.Cause(sctx); err != nil && cause != nil && !errors.Is(cause, context.Canceled) {
		err = cause
	}
	cancel(nil)
	watch.Wait()
	report := tcp.Report{Served: sres.Served}
	if err != nil {
		report.Error = err.Error()
	}
	if r.src.Session() != nil {
		r.report(report)
	}
	if err != nil {
		return err
	}
	r.fill()
	ms := time.Since(r.start).Milliseconds()
	r.res.Stats = &Stats{Shards: []ShardStats{{Size: r.res.StreamBytes, TransferMillis: ms}},
		Files: sres.Served, RawBytes: sres.Bytes, StoredBytes: r.res.StreamBytes, DurationMS: ms, Source: "tcp://" + r.res.Listen}
	return nil
}

// finishRestore ends a restore once CRIU has restored the tree of rep.PID
// (err: that, or what came before it, failed). The restored CUDA
// processes are still checkpointed, their device memory in host memory:
// it goes back onto the GPU and they run. The report for the sender names
// the PID only when both steps succeeded; otherwise the sender keeps its
// copy of the image and says so.
func finishRestore(ctx context.Context, c gpuckpt.CUDA, rep criusock.RestoreReport, err error, pairs []cudadriver.GPUPair) (tcp.Report, []int, gpuckpt.DriverTimings, error) {
	report := tcp.Report{Served: rep.Served}
	var cudaPIDs []int
	var t gpuckpt.DriverTimings
	if err == nil {
		if cudaPIDs, t, err = gpuckpt.Restore(ctx, c, rep.PID, pairs); err != nil {
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
