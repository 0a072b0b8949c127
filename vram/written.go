package vram

// What the copy out will hold (issue 36): each parked process's library
// finds its all-zero blocks on the device, and knows the ranges the
// program marked as caches (preload/written.c); the copy out then moves
// and keeps only the rest. The scan comes before the kept copy's
// directory is made and checked for room (room.go), so that both go by
// what the copy will hold, not by what the processes allocated.
//
// With --dedup the copy out also leaves out what an earlier checkpoint
// holds unchanged (earlier.go: Unchanged, a step between Scan and Room in
// gpuckpt's table), so Room asks for less again.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"

	"github.com/gpucr/gpucr-stream/fsat"
)

// Scan runs every process's zero scan at once: what its copy out will
// hold (need). Nothing to revert.
func (s *FastSuspension) Scan(ctx context.Context) error {
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
	return errors.Join(errs...)
}

// Room makes the kept copy's directory where none was given, sized by
// what the copy will hold (NewKeep), and checks that it has room for
// that (room.go). What it makes, RemoveKeep removes.
func (s *FastSuspension) Room(context.Context) error {
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
