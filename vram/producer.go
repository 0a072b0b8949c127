// Package vram is the GPU fast path's producer: the device memory of CUDA
// processes that run with libgpucr-preload leaves the device as VRAM files
// (a kept copy, stored into the checkpoint) and comes back from them, with
// the undo and the recovery after gpucr-stream's death (producer.go,
// kept.go). The driver's API is package cudadriver; the library's control
// protocol, package preloadctl.
package vram

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpucr/gpucr-stream/fsat"
	"github.com/gpucr/gpucr-stream/preloadctl"
	"golang.org/x/sys/unix"
)

// The GPU fast path: for processes that run with libgpucr-preload, device
// memory moves through the pipeline as producer files at pinned-copy speed
// and is released before the driver's checkpoint, which then only keeps
// the control state. Order (and why) in preload/control.c, gate.c and
// docs/PRODUCERS.md section 3:
//
//	checkpoint: park every process -> copy out (the library writes the
//	            kept copy, KeepDir) -> keep -> release -> store starts
//	            -> (caller) driver lock + checkpoint -> CRIU dump
//	            -> (caller) Wait for the store -> commit
//	restore:    (caller) CRIU restore -> driver restore + unlock -> remap ->
//	            copy in -> unpark
//
// The library's copy threads write the VRAM files straight into the kept
// copy (regular files gpucr-stream creates and hands over; no pipe, no
// read here), so the device is free once the pinned copies and the page
// cache writes are done. The store (the kept files into put, the capture)
// runs after the release, beside the driver's checkpoint and CRIU's dump;
// the caller waits for it (Wait) before it commits. The kept copy stays
// until the commit: a failure after the release (also of the store) maps
// the memory back and refills it from that copy before the program runs
// again.
//
// gpucr-stream may die (SIGKILL) in the middle, also while the store runs.
// The connections that parked the processes stay open until Detach, right
// before CRIU; the library holds descriptors of the kept copy (Keep,
// before the release). If a connection ends before BeforeDriver announced
// the driver's lock, the library refills from them and unparks by itself;
// after it, the process waits, parked, for `gpu resume --pid` (FastRecover
// after the driver's restore and unlock). The store only reads the kept
// copy: its death changes nothing for them. docs/PRODUCERS.md section 3
// lists the states.

// PutFunc stores one VRAM file of a checkpoint (the capture's WriteFile).
type PutFunc func(ctx context.Context, name string, r io.Reader) error

// GetFunc copies one VRAM file of a checkpoint into w (the source's Copy).
type GetFunc func(ctx context.Context, name string, w io.Writer) error

// StagedFunc hands over a VRAM file that was read into memory ahead of the
// copy in: a descriptor open for reading at the file's start, which stays
// the stager's to close, or nil where the file is not staged (get streams
// it).
type StagedFunc func(ctx context.Context, name string) (*os.File, error)

// FastOptions configures FastSuspend.
type FastOptions struct {
	// Dir holds the control sockets (preloadctl.Dir()).
	Dir string
	// Files per process: copy threads in the library, files in the
	// checkpoint (default DefaultFiles).
	Files int
	// ParkTimeout bounds the wait for CUDA calls in flight (default 10s).
	ParkTimeout time.Duration
	// KeepDir receives the copy kept for an undo (made 0700 if missing,
	// and it must be ours alone: files are created in it through its
	// descriptor, never by path). Keep, if not nil, is that directory
	// held open since it was made (scratch.Dir.File): then the path is not
	// looked up again. Without KeepDir, NewKeep makes the directory once
	// the zero scan knows how much the copy will hold (need bytes): a
	// tmpfs of its own where that fits in memory.
	KeepDir string
	Keep    *os.File
	NewKeep func(need int64) (path string, dir *os.File, err error)
	// Records holds gpucr-stream's record of each kept copy, for `gpu
	// resume --pid` (default DefaultRecords()).
	Records string
}

// DefaultFiles is the files (and copy threads) per process. One thread
// writes the page cache (tmpfs) at about 3 GB/s: 16, the cores of the
// H100 host, leave room to the 55 GB/s of pinned copies at 2 x 32 MiB of
// pinned memory each.
const DefaultFiles = 16

// FastProc is one process that took the fast path, for the manifest.
type FastProc struct {
	PID   int
	Files []string
	// Bytes is the device memory in its files: of the Written bytes (the
	// Allocated less the all-zero blocks), those not in a range the
	// program marked as a cache (Cached).
	Bytes                      int64
	Allocated, Written, Cached int64
	// Copy is where its copy out's time went.
	Copy preloadctl.CopyStats
}

// FastTimings are the fast path's steps: park, release and refill summed
// over the processes, copy out (all processes at once) and store as the
// time they took. Store runs beside the driver's checkpoint and CRIU's
// dump (set by Wait).
type FastTimings struct {
	// Stage is the staging of the copy threads' pinned buffers, before
	// the park (the processes still run); Scan, the zero scans (parked).
	Stage, Scan                           time.Duration
	Park, CopyOut, Release, Store, Refill time.Duration
	// Copy is the copy out of the process that took longest.
	Copy preloadctl.CopyStats
}

type fastProc struct {
	FastProc
	p                *preloadctl.Conn
	parked, released bool
	// ids are the kept files' (FastProc.Files in keepDir): every open
	// checks that the name still is that file.
	ids []fsat.ID
	// need is what its kept files will take (scanWritten).
	need int64
}

// FastSuspension is the state of the processes FastSuspend moved out.
type FastSuspension struct {
	opts FastOptions
	// keepDir is KeepDir, held open.
	keepDir *os.File
	procs   []*fastProc
	Timings FastTimings
	done    bool
	// The store after the release; stopStore cancels it, storeDone closes
	// once every goroutine of it has returned (storeErr, storeDur set).
	stopStore func(error)
	storeDone chan struct{}
	storeErr  error
	storeDur  time.Duration
}

// FastCheck reports on the library of every pid; it returns an error
// unless all of them have it loaded and can take the fast path.
func FastCheck(ctx context.Context, dir string, pids []int) ([]preloadctl.Report, error) {
	var reps []preloadctl.Report
	for _, pid := range pids {
		p, err := preloadctl.Dial(ctx, dir, pid)
		if err != nil {
			return reps, err
		}
		r, err := p.Report(ctx)
		p.Close()
		if err != nil {
			return reps, err
		}
		reps = append(reps, r)
		if !r.Capable {
			return reps, fmt.Errorf("process %d cannot take the fast path: %s", pid, r.Reason)
		}
		if r.Parked || r.Released {
			return reps, fmt.Errorf("process %d is parked by another checkpoint", pid)
		}
	}
	return reps, nil
}

// collectiveBarrier brings the processes of a tree to one collective
// boundary before any is parked (preload/gate.c, "The collective
// barrier"): each stops its next collective launch, and those that
// launched fewer than the most launch up to it. A tree without collectives
// passes at once. Unpark, or the end of the connections on an undo, lets
// the held launches go.
func (s *FastSuspension) collectiveBarrier(ctx context.Context) error {
	if len(s.procs) < 2 {
		return nil
	}
	counts := make([]int64, len(s.procs))
	var most int64
	for i, fp := range s.procs {
		n, err := fp.p.CollectivesHold(ctx)
		if err != nil {
			return fmt.Errorf("fast path: hold collectives: %w", err)
		}
		counts[i], most = n, max(most, n)
	}
	for i, fp := range s.procs {
		if counts[i] == most {
			continue
		}
		if _, err := fp.p.CollectivesUntil(ctx, most, s.opts.ParkTimeout); err != nil {
			return fmt.Errorf("fast path: process %d launched %d collectives, the others %d: bring it to theirs: %w", fp.PID, counts[i], most, err)
		}
	}
	return nil
}

// FastSuspend parks every process (all before any copy, so that none runs
// on while another is copied), has each library copy its device memory
// into KeepDir, hands it the kept copy and releases the memory. Then it
// starts storing the kept files into put and returns: the device is free,
// the store runs on until Wait (or Undo, or Commit). On failure it undoes
// what it did and returns the error joined with any error of the undo.
func FastSuspend(ctx context.Context, pids []int, put PutFunc, o FastOptions) (*FastSuspension, error) {
	if o.Files <= 0 {
		o.Files = DefaultFiles
	}
	if o.ParkTimeout <= 0 {
		o.ParkTimeout = 10 * time.Second
	}
	if o.KeepDir == "" && o.NewKeep == nil {
		return nil, errors.New("fast path: no directory for the copy kept until the commit")
	}
	if o.Records == "" {
		o.Records = DefaultRecords()
	}
	s := &FastSuspension{opts: o}
	if o.KeepDir != "" {
		if err := s.openKeep(o.KeepDir, o.Keep); err != nil {
			return nil, err
		}
	}
	for _, pid := range pids {
		p, err := preloadctl.Dial(ctx, o.Dir, pid)
		if err != nil {
			return s, s.undo(ctx, err)
		}
		s.procs = append(s.procs, &fastProc{FastProc: FastProc{PID: pid}, p: p})
	}
	// Staging is an optimization only: a library without it, or that
	// could not pin the memory now, allocates in the copy (and fails
	// there if it must). Every process stages at once: a tree's ranks
	// pinned one after the other took as long again.
	t := time.Now()
	var staging sync.WaitGroup
	for _, fp := range s.procs {
		staging.Go(func() { _ = fp.p.Stage(ctx, o.Files) })
	}
	staging.Wait()
	s.Timings.Stage = time.Since(t)
	t = time.Now()
	err := s.collectiveBarrier(ctx)
	s.Timings.Park += time.Since(t)
	if err != nil {
		return s, s.undo(ctx, err)
	}
	for _, fp := range s.procs {
		t := time.Now()
		err := fp.p.Park(ctx, o.ParkTimeout)
		s.Timings.Park += time.Since(t)
		if err != nil {
			return s, s.undo(ctx, err)
		}
		fp.parked = true
	}
	if err := s.matchShared(ctx); err != nil {
		return s, s.undo(ctx, err)
	}
	// Parked here, so not waiting for `gpu resume --pid`: a copy still
	// recorded for them is stale, as is one of a process that is gone.
	sweepRecords(o.Records, pids)
	if err := s.scanWritten(ctx); err != nil {
		return s, s.undo(ctx, err)
	}
	// Every process copies out at once: each library has its own copy
	// threads and pinned buffers, and a tree's processes (tensor-parallel
	// ranks) usually sit on different GPUs.
	t = time.Now()
	errs := make([]error, len(s.procs))
	var wg sync.WaitGroup
	for i, fp := range s.procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = s.copyOut(ctx, fp)
			if errs[i] == nil {
				errs[i] = s.record(fp)
			}
			if errs[i] == nil {
				errs[i] = s.keep(ctx, fp)
			}
		}()
	}
	wg.Wait()
	s.Timings.CopyOut += time.Since(t)
	for _, fp := range s.procs {
		if fp.Copy.Work >= s.Timings.Copy.Work {
			s.Timings.Copy = fp.Copy
		}
	}
	if err := errors.Join(errs...); err != nil {
		return s, s.undo(ctx, err)
	}
	for _, fp := range s.procs {
		t := time.Now()
		fp.released = true // a failed release may have freed part of it
		err := fp.p.Release(ctx)
		s.Timings.Release += time.Since(t)
		if err != nil {
			return s, s.undo(ctx, err)
		}
	}
	// The connections stay until Detach: their end without it tells the
	// library that gpucr-stream is gone.
	s.startStore(ctx, put)
	testPause("released")
	return s, nil
}

// errUndone stops a store whose checkpoint is being undone.
var errUndone = errors.New("fast path: the checkpoint is undone")

// startStore stores every kept file into put, all at once (the capture
// bounds its memory). The first failure cancels the others.
func (s *FastSuspension) startStore(parent context.Context, put PutFunc) {
	ctx, cancel := context.WithCancelCause(parent)
	s.stopStore, s.storeDone = cancel, make(chan struct{})
	start := time.Now()
	var wg sync.WaitGroup
	var failed atomic.Bool
	for _, fp := range s.procs {
		for k, name := range fp.Files {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := s.storeFile(ctx, put, fp, k); err != nil {
					failed.Store(true)
					cancel(fmt.Errorf("process %d: store %s: %w", fp.PID, name, err))
				}
			}()
		}
	}
	go func() {
		wg.Wait()
		s.storeDur = time.Since(start)
		if failed.Load() {
			s.storeErr = context.Cause(ctx)
		}
		cancel(nil)
		close(s.storeDone)
	}()
}

// storeFile puts fp's k-th kept file; a cancelled store ends at its next
// read.
func (s *FastSuspension) storeFile(ctx context.Context, put PutFunc, fp *fastProc, k int) error {
	fs, err := openFiles(s.keepDir, fp.Files[k:k+1], fp.ids[k:k+1])
	if err != nil {
		return err
	}
	defer closeAll(fs)
	testHoldStore()
	if err := testStoreFault(); err != nil {
		return err
	}
	return put(ctx, fp.Files[k], ctxReader{ctx, fs[0]})
}

type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if c.ctx.Err() != nil {
		return 0, context.Cause(c.ctx)
	}
	return c.r.Read(p)
}

// Wait waits for the store that FastSuspend started and returns its error
// (the first file that failed); call it before the capture's commit. If
// ctx ends first, the store is cancelled (and waited for). Again: the same
// answer.
func (s *FastSuspension) Wait(ctx context.Context) error {
	if s == nil || s.storeDone == nil {
		return nil
	}
	select {
	case <-s.storeDone:
	case <-ctx.Done():
		s.stopStore(context.Cause(ctx))
		<-s.storeDone
	}
	s.Timings.Store = s.storeDur
	return s.storeErr
}

// keep hands fp's library the kept copy, now complete.
func (s *FastSuspension) keep(ctx context.Context, fp *fastProc) error {
	fs, err := openFiles(s.keepDir, fp.Files, fp.ids)
	if err != nil {
		return fmt.Errorf("process %d: kept copy: %w", fp.PID, err)
	}
	defer closeAll(fs)
	return fp.p.Keep(ctx, s.keepDir, fs)
}

// record writes gpucr-stream's record of fp's kept copy, for `gpu resume
// --pid` should this run die.
func (s *FastSuspension) record(fp *fastProc) error {
	start, err := startTime(fp.PID)
	if err != nil {
		return fmt.Errorf("process %d: %w", fp.PID, err)
	}
	dirID, err := fsat.IDOf(s.keepDir)
	if err != nil {
		return err
	}
	return writeRecord(s.opts.Records, keptRecord{PID: fp.PID, Start: start, Dir: s.opts.KeepDir, DirID: dirID, Files: fp.Files, IDs: fp.ids})
}

func closeAll(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
}

// BeforeDriver tells every library that the driver's lock comes next:
// should gpucr-stream die from now on, the processes wait for `gpu resume
// --pid` instead of refilling themselves (their CUDA calls would block on
// the driver's lock).
func (s *FastSuspension) BeforeDriver(ctx context.Context) error {
	for _, fp := range s.procs {
		if err := fp.p.Driver(ctx); err != nil {
			return err
		}
	}
	return nil
}

// Detach lets go of the processes before CRIU dumps them: CRIU must find
// no connection to a process outside the tree, nor the kept files open in
// the processes. The libraries keep the kept copy's paths for `gpu resume`.
func (s *FastSuspension) Detach(ctx context.Context) error {
	testPause("checkpointed")
	var errs []error
	for _, fp := range s.procs {
		if fp.p == nil {
			continue
		}
		errs = append(errs, fp.p.Detach(ctx))
		fp.p.Close()
		fp.p = nil
	}
	testPause("detached")
	return errors.Join(errs...)
}

// pipePair makes a pipe with a large buffer (fewer wake-ups per GB).
func pipePair() (r, w *os.File, err error) {
	r, w, err = os.Pipe()
	if err != nil {
		return nil, nil, err
	}
	// 4 MiB where allowed (root may exceed pipe-max-size), else 1 MiB.
	if _, err := unix.FcntlInt(w.Fd(), unix.F_SETPIPE_SZ, 4<<20); err != nil {
		_, _ = unix.FcntlInt(w.Fd(), unix.F_SETPIPE_SZ, 1<<20)
	}
	return r, w, nil
}

// fileName is the k-th VRAM file of process pid, vram-PID-KK.bin.
func fileName(pid, k int) string { return fmt.Sprintf("vram-%d-%02d.bin", pid, k) }

// FilePID is the PID in a VRAM file's name (fileName): how a restore
// finds the fast path's files in a stream, which has no manifest.
func FilePID(name string) (int, bool) {
	rest, ok := strings.CutPrefix(name, "vram-")
	if !ok {
		return 0, false
	}
	p, k, ok := strings.Cut(strings.TrimSuffix(rest, ".bin"), "-")
	if !ok || !strings.HasSuffix(rest, ".bin") || len(k) != 2 || !digits(p) || !digits(k) {
		return 0, false
	}
	pid, err := strconv.Atoi(p)
	return pid, err == nil && pid > 0
}

func digits(s string) bool {
	return s != "" && strings.Trim(s, "0123456789") == ""
}

// copyOut has fp's library write its device memory into the kept copy:
// files created here (new, 0600, in KeepDir through its descriptor) whose
// descriptors it writes to.
func (s *FastSuspension) copyOut(ctx context.Context, fp *fastProc) error {
	var ws []*os.File
	defer func() { closeAll(ws) }()
	for k := 0; k < s.opts.Files; k++ {
		name := fileName(fp.PID, k)
		w, err := fsat.Create(s.keepDir, name, unix.O_WRONLY, 0o600)
		if err != nil {
			return fmt.Errorf("process %d: copy out: %w", fp.PID, err)
		}
		ws = append(ws, w)
		id, err := fsat.IDOf(w)
		if err != nil {
			return err
		}
		fp.Files = append(fp.Files, name)
		fp.ids = append(fp.ids, id)
	}
	cs, err := fp.p.CopyOut(ctx, ws)
	fp.Bytes, fp.Copy = cs.Bytes, cs
	if err != nil {
		return fmt.Errorf("process %d: copy out into %s: %w", fp.PID, s.opts.KeepDir, err)
	}
	return nil
}

// undo reverts a partial FastSuspend and joins cause with its errors.
func (s *FastSuspension) undo(ctx context.Context, cause error) error {
	if err := s.Undo(ctx); err != nil {
		return errors.Join(cause, fmt.Errorf("undo failed, device memory of the process may be missing: %w", err))
	}
	return cause
}

// Undo brings every process back as it was, in reverse order: what was
// released is mapped again and refilled from the kept copy, then the
// process is unparked. For a checkpoint that failed after FastSuspend, and
// for --leave-running after the commit. A store still running is
// cancelled first, and waited for after the refill: the refill reads the
// kept copy through its own descriptors, and must not wait on a
// destination that stalls. A second call does nothing.
func (s *FastSuspension) Undo(ctx context.Context) error {
	if s == nil || s.done {
		return nil
	}
	s.done = true
	if s.stopStore != nil {
		s.stopStore(errUndone)
	}
	// The undo runs even when the checkpoint was cancelled.
	ctx = context.WithoutCancel(ctx)
	var errs []error
	for i := len(s.procs) - 1; i >= 0; i-- {
		fp := s.procs[i]
		if !fp.parked {
			if fp.p != nil {
				fp.p.Close()
			}
			continue
		}
		if err := s.refill(ctx, fp); err != nil {
			errs = append(errs, err)
		}
	}
	// Memory the processes import from each other, once every one is
	// refilled.
	var pids []int
	for _, fp := range s.procs {
		pids = append(pids, fp.PID)
	}
	if err := Reimport(ctx, s.opts.Dir, pids); err != nil {
		errs = append(errs, err)
	}
	if s.storeDone != nil {
		<-s.storeDone
	}
	s.removeKeep()
	return errors.Join(errs...)
}

// refill sends recover: remap, copy in from the kept copy, unpark, all in
// the library, which has done it already if the owning connection ended
// before the driver's lock (recover then finds it running).
func (s *FastSuspension) refill(ctx context.Context, fp *fastProc) error {
	// The owning connection while it is in step (its end would look like
	// gpucr-stream's death), else a fresh one (the library answers one
	// connection at a time, after the last).
	if fp.p == nil || fp.p.Broken() {
		if fp.p != nil {
			fp.p.Close()
		}
		p, err := preloadctl.Dial(ctx, s.opts.Dir, fp.PID)
		if err != nil {
			return err
		}
		fp.p = p
	}
	defer func() { fp.p.Close(); fp.p = nil }()
	t := time.Now()
	var fs []*os.File
	if fp.released {
		// Where they cannot be opened, the library tries its own.
		fs, _ = openFiles(s.keepDir, fp.Files, fp.ids)
		defer closeAll(fs)
	}
	err := fp.p.Recover(ctx, fs)
	s.Timings.Refill += time.Since(t)
	if err != nil {
		// The program stays parked: it never runs without its memory.
		return fmt.Errorf("process %d: refill from %s: %w (it stays parked)", fp.PID, s.opts.KeepDir, err)
	}
	fp.released, fp.parked = false, false
	return nil
}

// Commit is for a checkpoint that is committed and whose processes are
// gone (or dumped): the kept copy goes. Connections still held are
// detached: the processes stay parked, their memory in the checkpoint.
func (s *FastSuspension) Commit() {
	if s == nil {
		return
	}
	s.done = true
	_ = s.Wait(context.Background()) // done before the commit: returns at once
	_ = s.Detach(context.Background())
	s.removeKeep()
}

// removeKeep removes the kept copy and its records, a file per
// goroutine: freeing the pages of GBs of tmpfs takes a while, and scales
// with the cores.
func (s *FastSuspension) removeKeep() {
	var wg sync.WaitGroup
	for _, fp := range s.procs {
		for k := range fp.Files {
			wg.Add(1)
			go func() {
				defer wg.Done()
				removeFiles(s.keepDir, fp.Files[k:k+1], fp.ids[k:k+1])
			}()
		}
	}
	wg.Wait()
	for _, fp := range s.procs {
		if len(fp.ids) > 0 {
			removeRecord(s.opts.Records, fp.PID)
		}
	}
	s.keepDir.Close()
}

// Procs are the processes moved out, with their files.
func (s *FastSuspension) Procs() []FastProc {
	if s == nil {
		return nil
	}
	var out []FastProc
	for _, fp := range s.procs {
		out = append(out, fp.FastProc)
	}
	return out
}

// Bytes is the device memory copied out, over all processes.
func (s *FastSuspension) Bytes() int64 {
	var n int64
	for _, fp := range s.Procs() {
		n += fp.Bytes
	}
	return n
}

// FastResume brings a restored process's device memory back: it maps
// fresh memory where the old was, copies the files in (the library reads
// those staged, if staged is not nil, itself; get streams the others from
// the checkpoint), and unparks it, unless it maps memory of another
// process: then it stays parked for Reimport, once all are refilled. Call
// it after the driver's restore and unlock. On failure the process stays
// parked, its memory not refilled: it does not run on with missing memory.
func FastResume(ctx context.Context, dir string, pid int, files []string, get GetFunc, staged StagedFunc) (remap, copyIn time.Duration, cs preloadctl.CopyStats, err error) {
	// remap counts from the dial, copyIn to the unpark: the two cover it
	// all.
	t := time.Now()
	p, err := preloadctl.Dial(ctx, dir, pid)
	if err != nil {
		return time.Since(t), 0, cs, err
	}
	defer p.Close()
	if err := p.Remap(ctx); err != nil {
		return time.Since(t), 0, cs, err
	}
	remap = time.Since(t)
	t = time.Now()
	defer func() { copyIn = time.Since(t) }()
	if cs, err = copyInFrom(ctx, p, files, get, staged); err != nil {
		return remap, 0, cs, fmt.Errorf("process %d: copy in: %w (it stays parked)", pid, err)
	}
	// A process that maps another's memory waits, parked, for Reimport.
	if sh, err := p.Shared(ctx); err != nil || sh.Pending() {
		return remap, 0, cs, err
	}
	return remap, 0, cs, p.Unpark(ctx)
}

func copyInFrom(ctx context.Context, p *preloadctl.Conn, files []string, get GetFunc, staged StagedFunc) (preloadctl.CopyStats, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	// rs[k] is what the library reads file k from: the staged file, or
	// the read end of a pipe that get fills through ws[k]. Ours to close
	// are the pipes (closing one twice is harmless).
	rs, ws := make([]*os.File, len(files)), make([]*os.File, len(files))
	defer func() {
		for k := range ws {
			if ws[k] != nil {
				rs[k].Close()
				ws[k].Close()
			}
		}
	}()
	for k, name := range files {
		if staged != nil {
			f, err := staged(ctx, name)
			if err != nil {
				return preloadctl.CopyStats{}, fmt.Errorf("%s: %w", name, err)
			}
			if rs[k] = f; f != nil {
				continue
			}
		}
		r, w, err := pipePair()
		if err != nil {
			return preloadctl.CopyStats{}, err
		}
		rs[k], ws[k] = r, w
	}
	var wg sync.WaitGroup
	errs := make([]error, len(files))
	for k := range files {
		if ws[k] == nil {
			continue
		}
		wg.Add(1)
		go func(w *os.File) {
			defer wg.Done()
			defer w.Close() // the library's end of file
			if err := get(ctx, files[k], w); err != nil {
				errs[k] = fmt.Errorf("%s: %w", files[k], err)
				cancel(err)
			}
		}(ws[k])
	}
	n, err := p.CopyIn(ctx, rs)
	for k := range ws {
		if ws[k] != nil {
			rs[k].Close() // a writer still blocked gets EPIPE
		}
	}
	wg.Wait()
	return n, errors.Join(append([]error{err}, errs...)...)
}
