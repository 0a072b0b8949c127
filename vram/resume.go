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
