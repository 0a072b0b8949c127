package gpuckpt

// Staging (issue 23): a restore from an archive reads the VRAM files of the
// fast path's processes into memory while CRIU restores, so that the copy
// in after the driver's restore reads memory instead of the archive (fetch,
// checksum, decode: the copy in's bound before) and runs near the bus's
// speed. Each file is read whole into an unnamed file on a tmpfs of huge
// pages of the stage's own (package scratch; else a memfd, whose small
// pages read slower and took about a second to free for 12 GB) and checked
// on the way, as any read of the archive is; the library then reads it
// through a read-only descriptor of its own. Files are staged a few at a
// time, interleaved over the processes (so each has as much staged), while
// their sum stays within a memory limit; one that does not fit is left to
// the copy in, which streams it as without staging. A file the copy in
// asks for before its staging began is streamed too (and no longer
// staged); one being staged is waited for.
//
// CRIU comes first: the staging reads through the archive's Behind view,
// with a read-ahead budget of its own, so it never takes the tokens that
// the files CRIU waits for read ahead with (taking them slowed CRIU's
// restore of an NCCL pair from 3.3 to 4.2 s). The staged files stay the
// stage's until Close, after the copy in, so that their memory is freed
// once the processes run, not while they wait.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/fsat"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/scratch"
	"github.com/gpucr/gpucr-stream/source"
)

// Stage is the VRAM files of one restore being read ahead into memory.
type Stage struct {
	cancel  context.CancelCauseFunc
	wg      sync.WaitGroup
	started time.Time
	dir     *scratch.Dir // the tmpfs of huge pages; nil: memfds

	mu    sync.Mutex
	files map[string]*stagedFile
	order []string // staging order
	next  int      // order[next] is the next to stage
	limit int64
	bytes int64 // reserved by files staged or being staged
	took  time.Duration
	// staged files and their bytes, for Phases
	staged      int
	stagedBytes int64
}

type stagedFile struct {
	size  int64
	state stageState
	f     *os.File      // stageDone: read-only, at offset 0; the stage's to close
	err   error         // stageDone: why it is not there
	done  chan struct{} // closed when stageRunning ends
}

type stageState int

const (
	stageQueued  stageState = iota
	stageRunning            // being read into memory
	stageDone               // f or err
	stageTaken              // handed over, or left to the copy in
)

// stageRoot is where a stage mounts its tmpfs (tests name one that
// cannot be, for the memfds).
var stageRoot = scratch.DefaultRoot

// StageMemory is how much memory a restore may stage VRAM files in: 0 is
// auto (half of what is available, less what CRIU's images will take in
// the restored processes, which go into memory too), negative none.
type StageMemory int64

// limit is m in bytes, for a restore whose CRIU images are imageBytes.
func (m StageMemory) limit(imageBytes int64) int64 {
	switch {
	case m < 0:
		return 0
	case m > 0:
		return int64(m)
	}
	return max(0, proc.AvailableMemory()/2-imageBytes)
}

// StartStage starts reading the VRAM files of procs' fast-path processes
// from src into memory, within m. Close it once the copy in is done (or
// did not happen); a nil Stage (nothing to stage) is closed too.
func StartStage(ctx context.Context, src source.Source, procs []manifest.CUDAProcess, m StageMemory) (*Stage, error) {
	if m < 0 || !slices.ContainsFunc(procs, func(p manifest.CUDAProcess) bool { return p.Path == manifest.CUDAPathPreload }) {
		return nil, nil
	}
	infos, err := src.Files(ctx)
	if err != nil {
		return nil, fmt.Errorf("stage VRAM files: %w", err)
	}
	size := make(map[string]int64, len(infos))
	var images int64 // what CRIU restores: all but the VRAM files
	for _, f := range infos {
		size[f.Name] = f.Size
		images += f.Size
	}
	for _, p := range procs {
		images -= p.Bytes
	}
	s := &Stage{files: map[string]*stagedFile{}, limit: m.limit(images), started: time.Now()}
	var vramBytes int64
	// File k of every process, then file k+1: each process as far along.
	for k := 0; ; k++ {
		more := false
		for _, p := range procs {
			if p.Path != manifest.CUDAPathPreload || k >= len(p.Files) {
				continue
			}
			more = true
			n, ok := size[p.Files[k]]
			if !ok {
				continue // the copy in names it missing
			}
			s.files[p.Files[k]] = &stagedFile{size: n, done: make(chan struct{})}
			s.order = append(s.order, p.Files[k])
			vramBytes += n
		}
		if !more {
			break
		}
	}
	if len(s.order) == 0 || s.limit <= 0 {
		return nil, nil // nothing to stage, or no memory for it
	}
	if d, err := scratch.New(stageRoot, "", "gpucr-stage-", min(vramBytes, s.limit)); err == nil && d.Mounted {
		s.dir = d
	} else if err == nil {
		d.Remove() // not a tmpfs of its own: memfds
	}
	// A few files at once, a few fetchers each, keep the archive busy
	// without taking CRIU's cores: a quarter of them. With an eighth (two
	// files at once on 16 cores) a deduplicated checkpoint's 12 GiB were
	// staged in 1.2-1.4 s, after CRIU's restore, and the copy in waited;
	// with four, 0.6-0.8 s, CRIU's restore no slower (0.84-1.03 s).
	workers := min(len(s.order), max(2, runtime.NumCPU()/4))
	const fetchers = 4
	if a := location.ArchiveOf(src); a != nil {
		src = a.Behind(fetchers, 2*workers*fetchers)
	}
	ctx, s.cancel = context.WithCancelCause(context.WithoutCancel(ctx))
	s.wg.Add(workers)
	for range workers {
		go s.work(ctx, src)
	}
	return s, nil
}

// work stages files until none is left to start.
func (s *Stage) work(ctx context.Context, src source.Source) {
	defer s.wg.Done()
	for {
		name, sf := s.claim()
		if sf == nil {
			return
		}
		f, err := s.stageFile(ctx, src, name)
		s.mu.Lock()
		sf.f, sf.err, sf.state = f, err, stageDone
		if err == nil {
			s.staged++
			s.stagedBytes += sf.size
		}
		s.took = time.Since(s.started)
		s.mu.Unlock()
		close(sf.done)
	}
}

// claim takes the next queued file that fits within the limit.
func (s *Stage) claim() (string, *stagedFile) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for ; s.next < len(s.order); s.next++ {
		name := s.order[s.next]
		sf := s.files[name]
		if sf.state != stageQueued || s.bytes+sf.size > s.limit {
			continue
		}
		s.next++
		s.bytes += sf.size
		sf.state = stageRunning
		return name, sf
	}
	return "", nil
}

// stageFile reads one file of src into a fresh unnamed file and returns a
// read-only descriptor of it at offset 0.
func (s *Stage) stageFile(ctx context.Context, src source.Source, name string) (*os.File, error) {
	var w *os.File
	if s.dir != nil {
		var err error
		if w, err = fsat.CreateUnnamed(s.dir.File()); err != nil {
			return nil, err
		}
	} else {
		fd, err := unix.MemfdCreate("gpucr-stage", unix.MFD_CLOEXEC)
		if err != nil {
			return nil, fmt.Errorf("a memfd to stage it in: %w", err)
		}
		w = os.NewFile(uintptr(fd), "gpucr-stage")
	}
	defer w.Close()
	if _, err := src.Copy(ctx, name, w); err != nil {
		return nil, err
	}
	r, err := os.Open("/proc/self/fd/" + strconv.Itoa(int(w.Fd())))
	if err != nil {
		return nil, fmt.Errorf("reopen the staged file read-only: %w", err)
	}
	return r, nil
}

// Take implements vram.StagedFunc: the staged file name (the stage's: Close
// closes it), waiting for it if it is being staged, or nil if it is not
// staged (then the copy in streams it).
func (s *Stage) Take(ctx context.Context, name string) (*os.File, error) {
	if s == nil {
		return nil, nil
	}
	s.mu.Lock()
	sf, ok := s.files[name]
	if !ok || sf.state == stageTaken {
		s.mu.Unlock()
		return nil, nil
	}
	if sf.state == stageQueued {
		sf.state = stageTaken
		s.mu.Unlock()
		return nil, nil
	}
	s.mu.Unlock()
	select {
	case <-sf.done:
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	sf.state = stageTaken
	return sf.f, sf.err
}

// Close stops the staging, waits for it, and frees the staged files.
func (s *Stage) Close() {
	if s == nil {
		return
	}
	s.cancel(errors.New("staging closed"))
	s.wg.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, sf := range s.files {
		if sf.f != nil {
			sf.f.Close()
			sf.f = nil
		}
	}
	s.dir.Remove()
}

// Phases say how much was staged and how long the staging took (from its
// start to the last file it read).
func (s *Stage) Phases() []Phase {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return []Phase{{fmt.Sprintf("vram staged ahead (%d of %d files, %.2f GiB)", s.staged, len(s.files), float64(s.stagedBytes)/(1<<30)), s.took.Seconds()}}
}
