package vram

// Peek is a migration's pre-copy round of device memory (issue 23): the
// library of each process copies its memory out while the program runs
// (preload/copy.c, copy_out_live), in the layout of a copy out, into
// unnamed files that put then stores. What it copies is a hint, torn where
// the program wrote meanwhile: the final copy out, parked, is exact, and
// finds at the receiver every chunk that did not change since (content
// ids: equal memory makes equal chunks, the layout being a function of the
// mappings alone). The processes go one after the other, so that at most
// one process's memory is held here at a time.

import (
	"context"
	"fmt"
	"io"
	"os"
	"sync"

	"github.com/gpucr/gpucr-stream/fsat"
	"github.com/gpucr/gpucr-stream/preloadctl"
)

// Peek copies the device memory of pids, while they run, into files
// unnamed files each in dir (a directory held open: the scratch space)
// and stores them with put, under the names a checkpoint gives them. It
// returns the bytes copied.
func Peek(ctx context.Context, sockDir string, dir *os.File, pids []int, files int, put PutFunc) (int64, error) {
	if files <= 0 {
		files = DefaultFiles
	}
	var n int64
	for _, pid := range pids {
		k, err := peekOne(ctx, sockDir, dir, pid, files, put)
		n += k
		if err != nil {
			return n, fmt.Errorf("process %d: peek: %w", pid, err)
		}
	}
	return n, nil
}

func peekOne(ctx context.Context, sockDir string, dir *os.File, pid, files int, put PutFunc) (int64, error) {
	p, err := preloadctl.Dial(ctx, sockDir, pid)
	if err != nil {
		return 0, err
	}
	defer p.Close()
	fs := make([]*os.File, 0, files)
	defer func() { closeAll(fs) }()
	for range files {
		f, err := fsat.CreateUnnamed(dir)
		if err != nil {
			return 0, err
		}
		fs = append(fs, f)
	}
	cs, err := p.Peek(ctx, fs)
	if err != nil {
		return cs.Bytes, err
	}
	// The files are read from their start, in parallel, as a
	// checkpoint's store reads its kept copy.
	errs := make([]error, files)
	var wg sync.WaitGroup
	for k, f := range fs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[k] = put(ctx, fileName(pid, k), ctxReader{ctx, io.NewSectionReader(f, 0, 1<<62)})
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return cs.Bytes, err
		}
	}
	return cs.Bytes, nil
}
