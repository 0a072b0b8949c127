package gpuckpt

// The GPU fast path around the CUDA policy of cuda.go (its steps are
// suspend.go's table, their mechanisms package vram's; docs/PRODUCERS.md
// section 3 has the order and why). Processes
// started with `gpucr-stream run` (libgpucr-preload) move their device
// memory into the capture themselves and release it before the driver's
// checkpoint, which then finds little to copy; a restore puts it back after
// the driver's restore. A copy is kept until the commit: any failure after
// the release maps the memory back and refills it before the program runs
// again (the undo of its steps, suspend.go). Processes without
// the library keep the driver-only path, unchanged.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"iter"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/scratch"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/vram"
)

// FastPathMode says whether CUDA processes with the library take the fast
// path.
type FastPathMode string

const (
	// FastPathAuto takes it when every CUDA process of the tree can.
	FastPathAuto FastPathMode = "auto"
	// FastPathOff leaves device memory to the driver's checkpoint.
	FastPathOff FastPathMode = "off"
)

// FastPath configures the fast path of a checkpoint or `gpu suspend --to`.
type FastPath struct {
	Mode FastPathMode // "" is FastPathAuto
	// Files per CUDA process: files in the checkpoint and copy threads in
	// the library, 1..64 (0: vram.DefaultFiles).
	Files int
	// KeepDir receives the copy of device memory kept until the commit,
	// for an undo ("": a tmpfs of huge pages of its own where it can, else
	// $TMPDIR; package scratch).
	KeepDir string
	// Dedup, for a --dedup checkpoint: the copy leaves out what an
	// earlier checkpoint of the process in the location holds unchanged
	// (earlier.go).
	Dedup *DedupTarget
}

// FastSuspend moves the device memory of cc's processes out of the device
// when every one of them runs with the library and can, and carried says
// that what restores c brings the VRAM files back (FastCarried; migrate: a
// receiver that restores); else it does nothing and the driver's checkpoint
// takes it all, as without the library. It returns once the memory is
// released, with the VRAM files still being stored into c (from the kept
// copy): the commit waits for them (FastWait, in checkpoint's dump). It
// records the path each process took in meta. On failure it has undone
// its steps: the processes run on.
func (cc *Checkpoint) FastSuspend(ctx context.Context, f FastPath, carried bool, c *streamer.Capture, meta *manifest.Manifest, log func(string)) ([]Phase, error) {
	if cc == nil {
		return nil, nil
	}
	cc.recordPaths(meta)
	if _, _, ok := cc.fastPossible(ctx, f, carried, log); !ok {
		return nil, nil
	}
	// The kept copy's directory is made once the zero scan knows what it
	// will hold (the written bytes): a tmpfs of its own where that fits.
	newKeep := func(need int64) (string, *os.File, error) {
		keep, err := scratch.New(scratch.DefaultRoot, f.KeepDir, "gpucr-vram-keep-", need)
		if err != nil {
			return "", nil, err
		}
		if keep.Why != "" {
			say(log, fmt.Sprintf("GPU fast path: the kept copy goes into %s, not a tmpfs of huge pages of its own: %s", keep.Path, keep.Why))
		}
		cc.keepDir = keep
		return keep.Path, keep.File(), nil
	}
	start := time.Now()
	d := cc.dedupFor(f.Dedup, log)
	if d != nil {
		d.Cuts = cutsInto(c)
	}
	err := cc.moveOut(ctx, putInto(c), vram.FastOptions{Dir: preloadctl.Dir(), Files: f.Files, NewKeep: newKeep, Dedup: d})
	var phases []Phase
	if cc.fast != nil {
		phases = cc.fastPhases(meta.GPUs)
	}
	if err != nil {
		return phases, err
	}
	cc.recordPaths(meta)
	if d := time.Since(start).Seconds(); d > 0 {
		v := cc.VRAM()
		say(log, fmt.Sprintf("GPU fast path: %.2f GiB of device memory moved out in %.2fs (%.1f GB/s): of %.2f GiB allocated, %.2f GiB written, %.2f GiB of it marked as caches (not kept)%s; storing it into the checkpoint from the kept copy",
			gib(v.Kept), d, float64(v.Kept)/d/1e9, gib(v.Allocated), gib(v.Written), gib(v.Cached), v.reusedNote()))
	}
	return phases, nil
}

// perProcess are the copy's time for each process of a tree of several
// (each rank of an NCCL job: one per GPU), naming the GPU where the
// checkpoint recorded one.
func perProcess(what string, procs []vram.FastProc, gpus []manifest.GPU) []Phase {
	if len(procs) < 2 {
		return nil
	}
	var ps []Phase
	for _, p := range procs {
		on := ""
		for _, g := range gpus {
			if g.PID == p.PID {
				on += " " + g.UUID
			}
		}
		if on != "" {
			on = " on" + on
		}
		ps = append(ps, Phase{fmt.Sprintf("vram %s: process %d%s (%.2f GiB)", what, p.PID, on, float64(p.Copy.Bytes)/(1<<30)), p.Copy.Work.Seconds()})
	}
	return ps
}

// putInto stores VRAM files into c, in the background (CRIU's dump goes
// first); a failure aborts c.
func putInto(c *streamer.Capture) vram.PutFunc {
	return func(ctx context.Context, name string, r io.Reader) error {
		return storeInto(ctx, c, name, func() (int64, error) { return c.WriteBackground(name, r) })
	}
}

// cutsInto stores a --dedup checkpoint's VRAM files into c by their cuts
// (vram.CutPut); a failure aborts c.
func cutsInto(c *streamer.Capture) *vram.CutPut {
	put := func(ctx context.Context, name string, cuts iter.Seq2[vram.Cut, error]) error {
		return storeInto(ctx, c, name, func() (int64, error) {
			return c.WriteCuts(name, func(yield func(streamer.Cut, error) bool) {
				for cut, err := range cuts {
					if !yield(streamer.Cut(cut), err) {
						return
					}
				}
			})
		})
	}
	return &vram.CutPut{Put: put, Knows: c.Knows, ChunkSize: c.ChunkSize()}
}

// storeInto runs write, which stores the VRAM file name into c.
func storeInto(ctx context.Context, c *streamer.Capture, name string, write func() (int64, error)) error {
	// A cancelled store (an undo, another file failed) also ends a write
	// that waits for room in c.
	stop := context.AfterFunc(ctx, func() { c.Abort(fmt.Errorf("GPU fast path: store %s: %w", name, context.Cause(ctx))) })
	defer stop()
	_, err := write()
	if err != nil {
		// The checkpoint fails: CRIU's dump into c stops now, not at
		// the commit.
		c.Abort(fmt.Errorf("GPU fast path: store %s: %w", name, err))
	}
	return err
}

// PrecopyVRAM is a pre-copy round of the device memory of cc's processes
// (vram.Peek), when every one of them can take the fast path and none
// runs NCCL collectives: their libraries copy it out while they run, into
// a scratch directory (as the kept copy's), and it is stored into c. Else
// it does nothing and says why. It returns the bytes copied.
func (cc *Checkpoint) PrecopyVRAM(ctx context.Context, f FastPath, c *streamer.Capture, log func(string)) (n int64, why string, err error) {
	reps, need, ok := cc.fastPossible(ctx, f, true, log)
	if !ok {
		return 0, "the CUDA processes do not all take the fast path (gpucr-stream run), which pre-copies device memory", nil
	}
	for _, r := range reps {
		// A pre-copy round of an NCCL pair, all_reduce back to back,
		// never ended on 2xH200: a process that runs collectives is not
		// copied while it runs.
		if r.Collectives > 0 {
			return 0, fmt.Sprintf("process %d runs NCCL collectives (%d launched): its device memory is not copied while it runs", r.PID, r.Collectives), nil
		}
	}
	dir, err := scratch.New(scratch.DefaultRoot, f.KeepDir, "gpucr-precopy-", need)
	if err != nil {
		return 0, "", fmt.Errorf("pre-copy of device memory: %w", err)
	}
	defer dir.Remove()
	n, err = vram.Peek(ctx, preloadctl.Dir(), dir.File(), cc.pids, f.Files, putInto(c))
	return n, "", err
}

// FastWait waits for the fast path's store into the capture (nil-safe);
// call it before the capture's Close.
func (cc *Checkpoint) FastWait(ctx context.Context) error {
	if cc == nil || cc.fast == nil {
		return nil
	}
	if err := cc.fast.Wait(ctx); err != nil {
		return fmt.Errorf("GPU fast path: %w", err)
	}
	return nil
}

// FastStorePhases times the store, which ran beside the driver's
// checkpoint and CRIU's dump (after FastWait).
func (cc *Checkpoint) FastStorePhases() []Phase {
	if cc == nil || cc.fast == nil {
		return nil
	}
	return []Phase{{"vram store (beside the dump)", cc.fast.StoreTime().Seconds()}}
}

// FastCarried says whether a checkpoint into dest can carry the fast
// path's files: an archive or S3, whose restore finds them through the
// manifest, or a stream (stdout, a stream file), whose restore finds them
// by name (FastProcs). tcp:// keeps the driver path: the receiver may
// serve an external criu restore, which would leave the processes parked
// with no device memory (migrate asks the receiver instead).
func FastCarried(dest location.Location) bool {
	return archived(dest) || dest.Kind == location.Stdio || dest.Kind == location.StreamFile
}

// archived says whether dest is an archive (local or S3): what `gpu resume
// --from` reads.
func archived(dest location.Location) bool {
	return dest.Kind == location.Archive || dest.Kind == location.S3
}

// errNotPreloaded: a process of the tree runs without the library (it
// was not started under `gpucr-stream run`): the driver's path, silently.
var errNotPreloaded = errors.New("a process runs without the fast-path library")

// fastCheck is what the fast path asks of the CUDA processes pids before
// it is taken (and CheckUndoable, before it lets an NCCL tree through):
// every one runs with the library, which says it can release and recreate
// all its device memory and is not parked by another checkpoint.
func fastCheck(ctx context.Context, pids []int) ([]preloadctl.Report, error) {
	for _, pid := range pids {
		if !preloadctl.Loaded(pid) {
			return nil, fmt.Errorf("process %d: %w", pid, errNotPreloaded)
		}
	}
	return vram.FastCheck(ctx, preloadctl.Dir(), pids)
}

// fastPossible says whether the fast path can be taken: f allows it, the
// destination carries the files, and every process has the library loaded
// and says it can: reps are the libraries' reports, need the device memory
// it would move.
func (cc *Checkpoint) fastPossible(ctx context.Context, f FastPath, carried bool, log func(string)) (reps []preloadctl.Report, need int64, ok bool) {
	if f.Mode == FastPathOff || !carried {
		return nil, 0, false
	}
	reps, err := fastCheck(ctx, cc.pids)
	if errors.Is(err, errNotPreloaded) {
		return nil, 0, false
	}
	if err != nil {
		say(log, fmt.Sprintf("GPU fast path not taken: %v", err))
		return nil, 0, false
	}
	for _, r := range reps {
		need += r.Bytes
	}
	return reps, need, true
}

// recordPaths records in meta which path each CUDA process's device memory
// took: the fast path's files, or the driver's checkpoint.
func (cc *Checkpoint) recordPaths(meta *manifest.Manifest) {
	meta.CUDA = nil
	byPID := map[int]vram.FastProc{}
	for _, p := range cc.fast.Procs() {
		byPID[p.PID] = p
	}
	for _, pid := range cc.pids {
		rec := manifest.CUDAProcess{PID: pid, Path: manifest.CUDAPathDriver}
		if ns := proc.NSPID(pid); ns != pid {
			rec.NSPID = ns
		}
		if p, ok := byPID[pid]; ok {
			rec.Path, rec.Files, rec.Bytes, rec.Hashes, rec.Handles = manifest.CUDAPathPreload, p.Files, p.Bytes, p.Hashes, p.Handles
		}
		meta.CUDA = append(meta.CUDA, rec)
	}
}

// restoredPID is the restored CUDA process, of pids, that the record p
// names: by its PID in its own namespace where the checkpoint recorded one
// (a restore into a new namespace, runc's, gives the process a new PID
// here, and its old one may now be another's), else by its PID. Where
// several have that namespace PID (processes in sibling namespaces, which
// plain CRIU gives back their PIDs here), the one with its PID. nsPID
// reads a process's (proc.NSPID). 0 where none is, or it is not clear.
func restoredPID(p manifest.CUDAProcess, pids []int, nsPID func(int) int) int {
	if p.NSPID == 0 {
		if slices.Contains(pids, p.PID) {
			return p.PID
		}
		return 0
	}
	var same []int
	for _, pid := range pids {
		if nsPID(pid) == p.NSPID {
			same = append(same, pid)
		}
	}
	switch {
	case len(same) == 1:
		return same[0]
	case slices.Contains(same, p.PID):
		return p.PID
	}
	return 0
}

// FastCommit drops the kept copy once the checkpoint is committed and the
// processes are dumped.
func (cc *Checkpoint) FastCommit() {
	if cc == nil || cc.fast == nil {
		return
	}
	cc.undo.forget()
	cc.fast.Commit()
	cc.keepDir.Remove()
	_ = cc.earlier.end(context.Background())
}

// VRAMSummary is what the fast path did with the device memory of the
// tree: allocated, written (not zero), marked as caches, stored in the
// VRAM files, copied out and kept until the commit, and, of the stored,
// taken from earlier checkpoints instead (--dedup).
type VRAMSummary struct {
	Allocated int64  `json:"allocated_bytes"`
	Written   int64  `json:"written_bytes"`
	Cached    int64  `json:"cached_bytes"`
	Stored    int64  `json:"stored_bytes"`
	Kept      int64  `json:"kept_bytes"`
	Reused    int64  `json:"earlier_bytes"`
	Earlier   string `json:"earlier,omitempty"`
}

// VRAM sums what the fast path did (nil where it was not taken).
func (cc *Checkpoint) VRAM() *VRAMSummary {
	if cc == nil || cc.fast == nil {
		return nil
	}
	v := &VRAMSummary{}
	for _, p := range cc.fast.Procs() {
		v.Allocated, v.Written, v.Cached = v.Allocated+p.Allocated, v.Written+p.Written, v.Cached+p.Cached
		v.Stored, v.Kept, v.Reused = v.Stored+p.Bytes, v.Kept+p.Copy.Bytes, v.Reused+p.Reused
		if p.Earlier != "" {
			v.Earlier = p.Earlier
		}
	}
	return v
}

func (v *VRAMSummary) reusedNote() string {
	if v.Reused == 0 {
		return ""
	}
	return fmt.Sprintf(", %.2f GiB unchanged since %s (not kept: the store and any undo read it there)", gib(v.Reused), v.Earlier)
}

// nsNote is ", PID N in its namespace" where the record has one.
func nsNote(p manifest.CUDAProcess) string {
	if p.NSPID == 0 {
		return ""
	}
	return fmt.Sprintf(" (PID %d in its namespace)", p.NSPID)
}

func gib(n int64) float64 { return float64(n) / (1 << 30) }

// FastRestore brings back the device memory of the restored processes that
// took the fast path (procs, from the manifest), after the driver's restore
// and unlock. Those that fail stay parked. It touches only the restored
// CUDA processes, pids: a record naming any other (a damaged or hostile
// checkpoint) is an error, never a copy into an unrelated process that
// runs with the library. The files staged (stage, which may be nil) are
// read from memory, the others from src; what fill filled during CRIU's
// restore is adopted instead (fill may be nil).
func FastRestore(ctx context.Context, src source.Source, stage *Stage, fill *Fill, procs []manifest.CUDAProcess, pids []int) ([]Phase, error) {
	var remap, copyIn time.Duration
	var slowest preloadctl.CopyStats
	var each []vram.FastProc // what each process's copy in took
	var errs []error
	var adopted int // processes that adopted what a filler filled
	var adoptErrs []Phase
	get := func(ctx context.Context, name string, w io.Writer) error {
		_, err := src.Copy(ctx, name, w)
		return err
	}
	// Every process is refilled at once, as they were copied out; the
	// phases are the longest process's.
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, p := range procs {
		if p.Path != manifest.CUDAPathPreload {
			continue
		}
		pid := restoredPID(p, pids, proc.NSPID)
		if pid == 0 {
			errs = append(errs, fmt.Errorf("the checkpoint records process %d%s on the fast path, but it is not one of the restored CUDA processes %v", p.PID, nsNote(p), pids))
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			// The filler was started for the record, before CRIU gave
			// the process its PID.
			res, err := vram.FastResume(ctx, preloadctl.Dir(), pid, p.Files, get, stage.Take, fill.Take(ctx, p.PID))
			mu.Lock()
			defer mu.Unlock()
			remap, copyIn = max(remap, res.Remap), max(copyIn, res.CopyIn)
			if res.Copy.Work >= slowest.Work {
				slowest = res.Copy
			}
			each = append(each, vram.FastProc{PID: pid, Copy: res.Copy})
			if res.Adopted > 0 {
				adopted++
			}
			if res.AdoptErr != nil {
				adoptErrs = append(adoptErrs, Phase{fmt.Sprintf("vram adopt of %d failed (copied in instead): %v", pid, res.AdoptErr), 0})
			}
			if err != nil {
				errs = append(errs, err)
			}
		}()
	}
	wg.Wait()
	if remap == 0 && copyIn == 0 && len(errs) == 0 {
		return nil, nil
	}
	// What the processes map of each other's memory, once all are
	// refilled (vram/shared.go).
	if len(errs) == 0 {
		t := time.Now()
		if err := vram.Reimport(ctx, preloadctl.Dir(), pids); err != nil {
			errs = append(errs, err)
		}
		copyIn += time.Since(t)
	}
	ps := append(stage.Phases(), fill.Phases()...)
	ps = append(ps, adoptErrs...)
	if adopted > 0 {
		// Their copy in ran in the fillers: here it is the unpark.
		ps = append(ps, Phase{fmt.Sprintf("vram fill adopted by %d process(es)", adopted), 0})
	}
	ps = append(ps, Phase{"vram remap", remap.Seconds()}, Phase{"vram copy in", copyIn.Seconds()})
	ps = append(ps, copyPhases("copy in", slowest)...)
	slices.SortFunc(each, func(a, b vram.FastProc) int { return a.PID - b.PID })
	ps = append(ps, perProcess("copy in", each, nil)...)
	if err := errors.Join(errs...); err != nil {
		return ps, fmt.Errorf("%w; the process stays parked (its device memory is not back)", err)
	}
	return ps, nil
}

// FastProcs are the CUDA records of the checkpoint src holds: an
// archive's manifest; for a stream, which carries no manifest a restore
// reads (the copy migrate keeps), the processes whose VRAM files it holds,
// by their names (vram-PID-KK.bin, flagged external). The library checks
// that a copy-in brings every piece of its memory, so a file that is
// missing fails the restore rather than losing memory.
func FastProcs(ctx context.Context, src source.Source) ([]manifest.CUDAProcess, error) {
	if m := source.ManifestOf(src); m != nil {
		return m.CUDA, nil
	}
	files, err := src.Files(ctx)
	if err != nil {
		return nil, err
	}
	var procs []manifest.CUDAProcess
	at := map[int]int{}
	for _, f := range files { // sorted by name
		pid, ok := vram.FilePID(f.Name)
		if !ok || !f.External {
			continue
		}
		i, seen := at[pid]
		if !seen {
			i = len(procs)
			at[pid] = i
			procs = append(procs, manifest.CUDAProcess{PID: pid, Path: manifest.CUDAPathPreload})
		}
		procs[i].Files = append(procs[i].Files, f.Name)
		procs[i].Bytes += f.Size
	}
	return procs, nil
}

// suspendTo is `gpu suspend --to DEST` for processes that run with the
// library: their device memory is released as soon as the library has
// copied it into the kept copy (res.MemoryReleasedSecs, from start), the
// driver's lock and checkpoint free the rest (the context;
// res.DeviceFreedSecs) while the VRAM files are stored, and it returns
// once the checkpoint at o.To is committed: the processes stay alive with
// no device memory. On failure everything is put back and they run on.
func suspendTo(ctx context.Context, drv cudadriver.Driver, pids []int, o GPUStepOptions, start time.Time, res *GPUStepResult) ([]Phase, error) {
	if o.FastPath.Mode == FastPathOff {
		return nil, errdefs.Usagef("gpu suspend --to needs the fast path (--fast-path auto)")
	}
	if _, err := vram.FastCheck(ctx, preloadctl.Dir(), pids); err != nil {
		return nil, fmt.Errorf("gpu suspend --to: %w", err)
	}
	c, _, err := location.StartCapture(ctx, o.To, o.Open)
	if err != nil {
		return nil, err
	}
	cc := &Checkpoint{drv: drv, pids: pids}
	meta := manifest.Manifest{Tool: o.Tool}
	fp := o.FastPath
	if o.Open.Options.Dedup {
		fp.Dedup = &DedupTarget{Dest: o.To, Open: o.Open}
	}
	phases, err := cc.FastSuspend(ctx, fp, archived(o.To), c, &meta, o.Log)
	if err == nil && cc.fast == nil {
		err = fmt.Errorf("gpu suspend --to %s: the fast path was not taken (gpu resume --from reads an archive: a directory or s3://)", o.To)
	}
	if err != nil {
		location.AbortCapture(ctx, c, err)
		return phases, err
	}
	res.MemoryReleasedSecs = time.Since(start).Seconds()
	say(o.Log, fmt.Sprintf("device memory released after %.2f s", res.MemoryReleasedSecs))
	ps, err := cc.Suspend(ctx, o.LockTimeout)
	phases = append(phases, ps...)
	if err != nil {
		// suspend has undone the fast path (the store stopped first).
		location.AbortCapture(ctx, c, err)
		return phases, err
	}
	res.DeviceFreedSecs = time.Since(start).Seconds()
	say(o.Log, fmt.Sprintf("device freed (the driver holds the context in host memory) after %.2f s; storing the VRAM files", res.DeviceFreedSecs))
	err = cc.FastWait(ctx)
	phases = append(phases, cc.FastStorePhases()...)
	if err != nil {
		location.AbortCapture(ctx, c, err)
		return phases, cc.Undo(err)
	}
	t := time.Now()
	_, err = c.Close(ctx, meta)
	phases = append(phases, Phase{"commit", time.Since(t).Seconds()})
	if err != nil {
		return phases, cc.Undo(err)
	}
	cc.FastCommit()
	return phases, nil
}

// resumeFrom is `gpu resume --from SRC`: the driver's restore and unlock,
// then the device memory of the processes that took the fast path comes
// back from the archive at o.From.
func resumeFrom(ctx context.Context, drv cudadriver.Driver, pids []int, o GPUStepOptions) ([]Phase, error) {
	src, err := location.OpenSource(ctx, o.From, o.Open, source.StreamSourceOptions{})
	if err != nil {
		return nil, err
	}
	defer src.Close()
	m := source.ManifestOf(src)
	if m == nil {
		return nil, errdefs.Usagef("gpu resume --from: %s is not an archive", o.From)
	}
	// The files are read into memory while the driver restores.
	procs := m.CUDA
	stage, err := StartStage(ctx, src, procs, o.Stage)
	if err != nil {
		return nil, err
	}
	defer stage.Close()
	// And filled into the device, beside the driver's restore.
	fill := StartFill(ctx, src, stage, procs, m.GPUs, o.Pairs)
	defer fill.Close()
	_, t, err := resumeRestored(drv, pids, o.Pairs)
	phases := TimingPhases(t)
	if err != nil {
		return phases, err
	}
	ps, err := FastRestore(ctx, src, stage, fill, procs, pids)
	return append(phases, ps...), err
}

// copyPhases are the parts of the slowest process's copy (what the copy
// threads' sums are, as a mean per thread): what bounds the VRAM phase, the
// device or the files.
func copyPhases(what string, c preloadctl.CopyStats) []Phase {
	if c.Workers == 0 {
		return nil
	}
	io, w := "writes", time.Duration(c.Workers)
	if what == "copy in" {
		io = "reads"
	}
	return []Phase{
		{"vram " + what + ": pinned buffers", c.Setup.Seconds()},
		{"vram " + what + ": device waits per thread", (c.Wait / w).Seconds()},
		{"vram " + what + ": " + io + " per thread", (c.IO / w).Seconds()},
		{"vram " + what + ": freeing buffers", c.Teardown.Seconds()},
	}
}
