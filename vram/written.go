package vram

// What the copy out will hold (issue 36): each parked process's library
// finds its all-zero blocks on the device, and knows the ranges the
// program marked as caches (preload/written.c); the copy out then moves
// and keeps only the rest. The scan comes before the kept copy's
// directory is made and checked for room (room.go), so that both go by
// what the copy will hold, not by what the processes allocated.
//
// The seam for --dedup (not done): the kept copy could also leave out the
// chunks the location already holds durably (the undo would refill those
// from the store); that needs the scan to say which blocks changed since
// the last checkpoint (devhash's block hashes) and the undo to read from
// the store, and it would go here, between the scan and the room check.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/fsat"
)

// scanWritten runs every process's zero scan at once, then makes the kept
// copy's directory where none was given, and checks that it has room for
// what the copy will hold.
func (s *FastSuspension) scanWritten(ctx context.Context) error {
	t := time.Now()
	errs := make([]error, len(s.procs))
	var wg sync.WaitGroup
	for i, fp := range s.procs {
		wg.Go(func() {
			w, err := fp.p.Scan(ctx)
			if err != nil {
				errs[i] = fmt.Errorf("fast path: zero scan: %w", err)
				return
			}
			fp.Allocated, fp.Written, fp.Cached = w.Allocated, w.Allocated-w.Zero, w.Cached
			// The files hold the stored bytes, a header padded to a page
			// per piece, and each a page of magic and end record at most.
			fp.need = w.Stored + (w.Pieces+int64(s.opts.Files))*4096
		})
	}
	wg.Wait()
	s.Timings.Scan = time.Since(t)
	if err := errors.Join(errs...); err != nil {
		return err
	}
	need := map[int]int64{}
	var total int64
	for _, fp := range s.procs {
		need[fp.PID] = fp.need
		total += fp.need
	}
	if s.keepDir == nil {
		path, dir, err := s.opts.NewKeep(total)
		if err != nil {
			return fmt.Errorf("fast path: the kept copy's directory: %w", err)
		}
		s.opts.KeepDir = path
		if err := s.openKeep(path, dir); err != nil {
			return err
		}
	}
	return checkRoom(s.keepDir, need)
}

// openKeep opens the kept copy's directory: dir held open, else path
// (made if missing); ours alone either way.
func (s *FastSuspension) openKeep(path string, dir *os.File) error {
	var err error
	var d *os.File
	if dir != nil {
		d, err = fsat.OpenDir(dir, ".")
		if err == nil {
			if err = fsat.CheckOwned(d); err != nil {
				d.Close()
			}
		}
	} else {
		d, err = fsat.MkdirOwned(path)
	}
	if err != nil {
		return fmt.Errorf("fast path: the kept copy's directory: %w", err)
	}
	s.keepDir = d
	return nil
}
