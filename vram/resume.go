package vram

// The fast path's restore: a restored process's device memory comes back
// from its VRAM files (after the driver's restore and unlock).

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/preloadctl"
	"golang.org/x/sys/unix"
)

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

// Filled is a process's device memory that a filler filled while CRIU
// restored it (preload/fill.c): the handle table it filled by, and an
// exported handle for each of the table's h rows, in order. The caller
// closes them.
type Filled struct {
	Table   *os.File
	Handles []*os.File
	// Copy is where the filler's copy in went.
	Copy preloadctl.CopyStats
}

// FastResume brings a restored process's device memory back: it maps
// fresh memory where the old was, copies the files in (the library reads
// those staged, if staged is not nil, itself; get streams the others from
// the checkpoint), and unparks it, unless it maps memory of another
// process: then it stays parked for Reimport, once all are refilled. What
// a filler filled (filled, which may be nil) is adopted instead, and if
// the process adopts all of it, nothing is copied in. Call it after the
// driver's restore and unlock. On failure the process stays parked, its
// memory not refilled: it does not run on with missing memory.
func FastResume(ctx context.Context, dir string, pid int, files []string, get GetFunc, staged StagedFunc, filled *Filled) (r Resumed, err error) {
	// Remap counts from the dial, CopyIn to the unpark: the two cover it
	// all.
	t := time.Now()
	p, err := preloadctl.Dial(ctx, dir, pid)
	if err != nil {
		return Resumed{Remap: time.Since(t)}, err
	}
	defer p.Close()
	if filled != nil {
		r.Adopted, r.AdoptErr = adopt(ctx, p, filled)
	}
	if err := p.Remap(ctx); err != nil {
		return Resumed{Remap: time.Since(t)}, err
	}
	r.Remap = time.Since(t)
	t = time.Now()
	defer func() { r.CopyIn = time.Since(t) }()
	if r.AdoptErr == nil && filled != nil && r.Adopted == len(filled.Handles) {
		r.Copy = filled.Copy
		return r, unparkUnlessShared(ctx, p)
	}
	r.Adopted = 0
	if r.Copy, err = CopyIn(ctx, p, files, get, staged); err != nil {
		return r, fmt.Errorf("process %d: copy in: %w (it stays parked)", pid, err)
	}
	return r, unparkUnlessShared(ctx, p)
}

// Resumed is what FastResume did: how long the remap (adoption included)
// and the copy in (to the unpark) took, the copy in's stats (the filler's,
// if the process adopted what it filled), how many handles it adopted,
// and why it adopted none, if it failed to.
type Resumed struct {
	Remap, CopyIn time.Duration
	Copy          preloadctl.CopyStats
	Adopted       int
	AdoptErr      error
}

// adopt hands the library what the filler filled, a batch at a time. A
// failure leaves the rest to the remap and the copy in (which rewrites
// what was adopted with the same bytes).
func adopt(ctx context.Context, p *preloadctl.Conn, filled *Filled) (int, error) {
	n := 0
	for from := 0; from < len(filled.Handles); from += preloadctl.AdoptBatch {
		k, err := p.Adopt(ctx, filled.Table, from, filled.Handles[from:min(from+preloadctl.AdoptBatch, len(filled.Handles))])
		n += k
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// unparkUnlessShared unparks the process, unless it maps another's memory:
// then it waits, parked, for Reimport.
func unparkUnlessShared(ctx context.Context, p *preloadctl.Conn) error {
	if sh, err := p.Shared(ctx); err != nil || sh.Pending() {
		return err
	}
	return p.Unpark(ctx)
}

// CopyIn has the library at p copy files in, each from staged where
// that hands it over, else through a pipe that get fills.
func CopyIn(ctx context.Context, p *preloadctl.Conn, files []string, get GetFunc, staged StagedFunc) (preloadctl.CopyStats, error) {
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
