// Package vram is the GPU fast path's producer: the mechanisms by which
// the device memory of CUDA processes that run with libgpucr-preload
// leaves the device as VRAM files and comes back from them. It owns the
// steps of a copy out, each for every process of a tree and each with its
// inverse (FastSuspension: park, zero scan, the kept copy, copy out,
// release, the store, refill; producer.go, written.go, room.go, store.go,
// shared.go), the restore (resume.go), the record of a kept copy and the
// recovery after gpucr-stream's death (kept.go), the files' format
// (format.go), the pre-copy (peek.go) and device hashing (devhash.go). In
// which order the steps run and what is undone when is package gpuckpt's;
// the driver's API is package cudadriver; the library's control protocol,
// package preloadctl.
package vram

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/fsat"
	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/testhook"
	"golang.org/x/sys/unix"
)

// The GPU fast path: for processes that run with libgpucr-preload, device
// memory moves through the pipeline as producer files at pinned-copy speed
// and is released before the driver's checkpoint, which then only keeps
// the control state. Order (and why) in preload/control.c, gate.c and
// docs/PRODUCERS.md section 3; gpuckpt/suspend.go runs the steps:
//
//	checkpoint: park every process -> zero scan -> room -> copy out (the
//	            library writes the kept copy, KeepDir) -> keep -> release
//	            -> store starts -> (caller) driver lock + checkpoint
//	            -> CRIU dump -> (caller) Wait for the store -> commit
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
// again (Refill).
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

// FastOptions configures a FastSuspension.
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
	// Dedup, for a --dedup checkpoint: the copy out leaves out what an
	// earlier checkpoint of the location holds unchanged, and the store
	// adds each process's BlockHashes (earlier.go).
	Dedup *Dedup
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
	// Reused are the bytes of Bytes not copied out nor kept: the earlier
	// checkpoint Earlier (LOC/NAME) holds them unchanged (--dedup).
	Reused  int64
	Earlier string
	// Hashes is its BlockHashes file in the checkpoint (--dedup).
	Hashes string
	// Handles is its handle table's file in the checkpoint (a restore's
	// fill, preload/fill.c); empty where the library gave none.
	Handles string
	// Copy is where its copy out's time went.
	Copy preloadctl.CopyStats
}

type fastProc struct {
	FastProc
	p                *preloadctl.Conn
	handles          []byte // its handle table, stored as Handles
	parked, released bool
	// ids are the kept files' (FastProc.Files in keepDir): every open
	// checks that the name still is that file.
	ids []fsat.ID
	// need is what its kept files will take (Scan, Unchanged).
	need int64
	// With --dedup (earlier.go): the earlier checkpoint found for it, the
	// blocks its copy out left out (nil: none) and the skip file that
	// says so in the kept copy's directory; key hashes its blocks; the
	// store gathers each file's pieces into its BlockHashes.
	earlier  *Earlier
	skip     *skipSet
	skipFile string
	skipID   fsat.ID
	key      uint64
	perFile  [][]hashedPiece
}

// FastSuspension is the processes of a tree whose device memory the fast
// path moves out, and what each step did to them. Its exported methods
// that take a context and return an error are the steps and their
// inverses, each for every process at once or in turn; every step records
// what it did, so that its inverse reverts exactly that. They run in the
// order of gpuckpt's table (gpuckpt/suspend.go).
type FastSuspension struct {
	opts FastOptions
	pids []int
	put  PutFunc
	// keepDir is KeepDir, held open.
	keepDir *os.File
	procs   []*fastProc
	// The store after the release; stopStore cancels it, storeDone closes
	// once every goroutine of it has returned (storeErr, storeDur set).
	stopStore func(error)
	storeDone chan struct{}
	storeErr  error
	storeDur  time.Duration
}

// NewFastSuspension is the fast path for the processes pids (none touched
// yet), storing their VRAM files with put.
func NewFastSuspension(pids []int, put PutFunc, o FastOptions) (*FastSuspension, error) {
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
	return &FastSuspension{opts: o, pids: pids, put: put}, nil
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

// OpenKeep opens the kept copy's directory where FastOptions name one
// (else Room makes it). Its inverse is RemoveKeep.
func (s *FastSuspension) OpenKeep(context.Context) error {
	if s.opts.KeepDir == "" {
		return nil
	}
	return s.openKeep(s.opts.KeepDir, s.opts.Keep)
}

// RemoveKeep waits for a store still running to end (StopStore cancels
// it), then removes the kept copy, its records and the directory's
// descriptor: the inverse of OpenKeep, and of all that Room and CopyOut
// wrote into it. The refill (Refill) reads the kept copy before.
//
// The kept copy of a process whose refill failed stays, with its record:
// it is parked without its memory, and `gpu resume --pid` refills it from
// there once what failed is fixed (Stranded).
func (s *FastSuspension) RemoveKeep(context.Context) error {
	if s.storeDone != nil {
		<-s.storeDone
	}
	s.removeKeep(false)
	return nil
}

// Stranded says that a process's memory is still released (its refill
// failed), so its kept copy stays where it is.
func (s *FastSuspension) Stranded() bool {
	return s != nil && slices.ContainsFunc(s.procs, func(fp *fastProc) bool { return fp.released })
}

// Dial connects to the library of every process. Its inverse is HangUp.
func (s *FastSuspension) Dial(ctx context.Context) error {
	for _, pid := range s.pids {
		p, err := preloadctl.Dial(ctx, s.opts.Dir, pid)
		if err != nil {
			return err
		}
		s.procs = append(s.procs, &fastProc{FastProc: FastProc{PID: pid}, p: p})
	}
	return nil
}

// HangUp ends every connection still held; the libraries' state stays.
// The connections that parked the processes are held until Detach: their
// end without it tells a library that gpucr-stream is gone (and that is
// what HangUp does to a library that is parked).
func (s *FastSuspension) HangUp(context.Context) error {
	for _, fp := range s.procs {
		if fp.p != nil {
			fp.p.Close()
			fp.p = nil
		}
	}
	return nil
}

// Stage has every library allocate its copy threads' pinned buffers while
// the program still runs, all at once (a tree's ranks pinned one after
// the other took as long again). An optimization only: a library without
// it, or that could not pin the memory now, allocates in the copy (and
// fails there if it must), so it never fails. The buffers are freed by
// the copy, the unpark or the connection's end.
func (s *FastSuspension) Stage(ctx context.Context) error {
	var staging sync.WaitGroup
	for _, fp := range s.procs {
		staging.Go(func() { _ = fp.p.Stage(ctx, s.opts.Files) })
	}
	staging.Wait()
	return nil
}

// HoldCollectives brings the processes of a tree to one collective
// boundary before any is parked (preload/gate.c, "The collective
// barrier"): each stops its next collective launch, and those that
// launched fewer than the most launch up to it. A tree without collectives
// passes at once. Unpark, or the end of the connections on an undo, lets
// the held launches go: it needs no inverse of its own.
func (s *FastSuspension) HoldCollectives(ctx context.Context) error {
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

// Park parks every process, all before any copy, so that none runs on
// while another is copied. Its inverse is Refill.
func (s *FastSuspension) Park(ctx context.Context) error {
	for _, fp := range s.procs {
		if err := fp.p.Park(ctx, s.opts.ParkTimeout); err != nil {
			return err
		}
		fp.parked = true
	}
	return nil
}

// Refill brings every process back as it was, the last first: what was
// released is mapped again and refilled from the kept copy, then the
// process is unparked (a refill that fails leaves it parked: it never runs
// without its memory). Then the connections end, and the memory the
// processes import from each other is mapped again, every one being
// refilled. The inverse of Park and Release; it reads the kept copy
// through its own descriptors, so a store that stalls does not hold it.
func (s *FastSuspension) Refill(ctx context.Context) error {
	var errs []error
	for i := len(s.procs) - 1; i >= 0; i-- {
		fp := s.procs[i]
		if !fp.parked {
			if fp.p != nil {
				fp.p.Close()
				fp.p = nil
			}
			continue
		}
		if err := s.refill(ctx, fp); err != nil {
			errs = append(errs, err)
		}
	}
	var pids []int
	for _, fp := range s.procs {
		pids = append(pids, fp.PID)
	}
	if err := Reimport(ctx, s.opts.Dir, pids); err != nil {
		errs = append(errs, err)
	}
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
	var fs []*os.File
	wait := func() error { return nil }
	switch {
	case fp.released && fp.skip != nil:
		// The kept copy left blocks out: whole files, or nothing.
		var err error
		if fs, wait, err = composedPipes(ctx, fp.composer(), s.keepDir, fp.Files, fp.ids); err != nil {
			return fmt.Errorf("process %d: refill from %s and %s: %w (it stays parked)", fp.PID, s.opts.KeepDir, fp.Earlier, err)
		}
	case fp.released:
		// Where they cannot be opened, the library tries its own.
		fs, _ = openFiles(s.keepDir, fp.Files, fp.ids)
	}
	err := fp.p.Recover(ctx, fs)
	closeAll(fs)
	if werr := wait(); err != nil && werr != nil {
		err = fmt.Errorf("%w (%w)", err, werr)
	}
	if err != nil {
		// The program stays parked: it never runs without its memory.
		return fmt.Errorf("process %d: refill from %s: %w (it stays parked, its kept copy with it: `gpucr-stream gpu resume --pid %d` refills it once what failed is fixed)",
			fp.PID, s.opts.KeepDir, err, fp.PID)
	}
	fp.released, fp.parked = false, false
	return nil
}

// SweepRecords drops the records of kept copies that are stale: those of
// processes now parked here (not waiting for `gpu resume --pid`), and of
// processes that are gone. Never fails.
func (s *FastSuspension) SweepRecords(context.Context) error {
	sweepRecords(s.opts.Records, s.pids)
	return nil
}

// CopyOut has every library copy its device memory into the kept copy,
// all at once (each library has its own copy threads and pinned buffers,
// and a tree's processes, tensor-parallel ranks, usually sit on different
// GPUs), then records each process's kept copy and hands it to its
// library. RemoveKeep removes what it wrote.
func (s *FastSuspension) CopyOut(ctx context.Context) error {
	errs := make([]error, len(s.procs))
	var wg sync.WaitGroup
	for i, fp := range s.procs {
		wg.Go(func() {
			errs[i] = s.copyOut(ctx, fp)
			if errs[i] == nil {
				errs[i] = s.writeSkip(fp)
			}
			if errs[i] == nil {
				errs[i] = s.record(fp)
			}
			if errs[i] == nil {
				errs[i] = s.keep(ctx, fp)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Release frees the device memory of every process. Refill, Park's
// inverse, is Release's too: the library's recover remaps, refills and
// unparks in one command.
func (s *FastSuspension) Release(ctx context.Context) error {
	for _, fp := range s.procs {
		fp.released = true // a failed release may have freed part of it
		if err := fp.p.Release(ctx); err != nil {
			return err
		}
	}
	return nil
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
	return writeRecord(s.opts.Records, keptRecord{PID: fp.PID, Start: start, Dir: s.opts.KeepDir, DirID: dirID, Files: fp.Files, IDs: fp.ids,
		Earlier: fp.Earlier, Skip: fp.skipFile, SkipID: fp.skipID})
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
	testhook.Pause(context.Background(), "checkpointed")
	var errs []error
	for _, fp := range s.procs {
		if fp.p == nil {
			continue
		}
		errs = append(errs, fp.p.Detach(ctx))
		fp.p.Close()
		fp.p = nil
	}
	testhook.Pause(context.Background(), "detached")
	return errors.Join(errs...)
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
	fp.Bytes, fp.Copy = cs.Bytes+cs.Earlier, cs
	if err != nil {
		return fmt.Errorf("process %d: copy out into %s: %w", fp.PID, s.opts.KeepDir, err)
	}
	if cs.Earlier != fp.Reused {
		return fmt.Errorf("process %d: copy out left out %d bytes, %d were asked: %w", fp.PID, cs.Earlier, fp.Reused, ErrVRAMFile)
	}
	// The handle table only speeds a restore up: without it (a library
	// that has no `handles`) the restore copies in after the driver's.
	if fp.handles, err = fp.p.Handles(ctx); err == nil {
		fp.Handles = handlesName(fp.PID)
	} else if fp.p.Broken() {
		return err
	}
	return nil
}

// handlesName is the handle table of process pid in a checkpoint.
func handlesName(pid int) string { return fmt.Sprintf("vram-%d.handles", pid) }

// Commit is for a checkpoint that is committed and whose processes are
// gone (or dumped): the kept copy goes. Connections still held are
// detached: the processes stay parked, their memory in the checkpoint.
func (s *FastSuspension) Commit() {
	if s == nil {
		return
	}
	_ = s.Wait(context.Background()) // done before the commit: returns at once
	_ = s.Detach(context.Background())
	s.removeKeep(true)
}

// removeKeep removes the kept copy and its records, a file per
// goroutine: freeing the pages of GBs of tmpfs takes a while, and scales
// with the cores. Without all, a process still released keeps its own.
func (s *FastSuspension) removeKeep(all bool) {
	var wg sync.WaitGroup
	for _, fp := range s.procs {
		if fp.released && !all {
			continue
		}
		for k := range fp.Files {
			wg.Add(1)
			go func() {
				defer wg.Done()
				removeFiles(s.keepDir, fp.Files[k:k+1], fp.ids[k:k+1])
			}()
		}
		if fp.skipFile != "" {
			removeFiles(s.keepDir, []string{fp.skipFile}, []fsat.ID{fp.skipID})
		}
	}
	wg.Wait()
	for _, fp := range s.procs {
		if len(fp.ids) > 0 && (all || !fp.released) {
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

// KeepDir is the kept copy's directory ("" until OpenKeep or Room).
func (s *FastSuspension) KeepDir() string { return s.opts.KeepDir }

// Reports asks every library for its report through the connection that
// holds it (parked, another connection would wait for that one's end).
func (s *FastSuspension) Reports(ctx context.Context) ([]preloadctl.Report, error) {
	var out []preloadctl.Report
	for _, fp := range s.procs {
		if fp.p == nil {
			return out, fmt.Errorf("process %d: not connected", fp.PID)
		}
		r, err := fp.p.Report(ctx)
		if err != nil {
			return out, err
		}
		out = append(out, r)
	}
	return out, nil
}

// Bytes is the device memory copied out, over all processes.
func (s *FastSuspension) Bytes() int64 {
	var n int64
	for _, fp := range s.Procs() {
		n += fp.Bytes
	}
	return n
}
