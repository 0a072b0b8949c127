package vram

// The store: the kept files go into the checkpoint (put, the capture),
// each as soon as the copy out has written it whole (the library says so
// file by file), beside the rest of the copy out, the release, the
// driver's checkpoint and CRIU's dump; the caller waits for it before the
// commit.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"iter"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpucr/gpucr-stream/testhook"
)

// ErrUndone stops a store whose checkpoint is being undone (StopStore).
var ErrUndone = errors.New("fast path: the checkpoint is undone")

// storeRun is a store under way: files are added (storeKept) while the
// copy out runs, until no more can come (close: the copy out ended, or
// the store was stopped); it is done once every file added has gone in.
type storeRun struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	put    PutFunc
	start  time.Time
	failed atomic.Bool

	mu     sync.Mutex
	closed bool
	ended  chan struct{} // closed with closed
	wg     sync.WaitGroup
	// first is when the first file began, after start (-1: none yet).
	first time.Duration

	done chan struct{} // closed once every goroutine of it has returned
	err  error         // the first failure (set when done closes)
	dur  time.Duration // start to the end of the last file
}

// StartStore readies the store: from now on each file the copy out
// completes goes into put at once, all of them at a time (the capture
// bounds its memory). It runs on until Wait, StopStore or Commit; the
// first failure cancels the others. Never fails.
func (s *FastSuspension) StartStore(ctx context.Context) error {
	s.startStore(ctx, s.put)
	return nil
}

// StopStore cancels a store still running (the undo of StartStore): it
// ends at its next read, and no file is added any more. RemoveKeep waits
// for it.
func (s *FastSuspension) StopStore(context.Context) error {
	if s.store != nil {
		s.store.cancel(ErrUndone)
		s.store.close()
	}
	return nil
}

// startStore starts the store into put, with no file yet.
func (s *FastSuspension) startStore(parent context.Context, put PutFunc) {
	ctx, cancel := context.WithCancelCause(parent)
	st := &storeRun{ctx: ctx, cancel: cancel, put: put, start: time.Now(), ended: make(chan struct{}), first: -1, done: make(chan struct{})}
	s.store = st
	go func() {
		<-st.ended
		st.wg.Wait()
		st.dur = time.Since(st.start)
		if st.failed.Load() {
			st.err = context.Cause(ctx)
		}
		cancel(nil)
		close(st.done)
	}()
}

// close says that no file will be added: the store is done once those
// added have gone in.
func (st *storeRun) close() {
	st.mu.Lock()
	defer st.mu.Unlock()
	if !st.closed {
		st.closed = true
		close(st.ended)
	}
}

// goStore runs f as a part of the store (false, and f is not run, once it
// is closed).
func (st *storeRun) goStore(f func() error, what string, pid int) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.closed {
		return false
	}
	if st.first < 0 {
		st.first = time.Since(st.start)
	}
	st.wg.Go(func() {
		if err := f(); err != nil {
			st.failed.Store(true)
			st.cancel(fmt.Errorf("process %d: store %s: %w", pid, what, err))
		}
	})
	return true
}

// storeKept stores fp's k-th kept file, which the copy out has just
// written whole; with --dedup, the last of fp's files to go in adds its
// block hashes. files counts fp's files still to go in.
func (s *FastSuspension) storeKept(fp *fastProc, k int, files *sync.WaitGroup) {
	st := s.store
	files.Add(1)
	if !st.goStore(func() error { defer files.Done(); return s.storeFile(st.ctx, st.put, fp, k) }, fp.Files[k], fp.PID) {
		files.Done()
	}
}

// storeHashesAfter adds fp's BlockHashes once its files have gone in:
// the copy out of fp succeeded, so every file of fp was added (--dedup).
func (s *FastSuspension) storeHashesAfter(fp *fastProc, files *sync.WaitGroup) {
	st := s.store
	st.goStore(func() error {
		files.Wait()
		return s.storeHashes(st.ctx, st.put, fp)
	}, fp.Hashes, fp.PID)
}

// storeFile puts fp's k-th kept file; a cancelled store ends at its next
// read. With --dedup the file goes in as its cuts (storecut.go): the
// groups of blocks the earlier checkpoint holds unchanged by its chunks,
// the rest read, every block read hashed for the process's BlockHashes.
func (s *FastSuspension) storeFile(ctx context.Context, put PutFunc, fp *fastProc, k int) error {
	fs, err := openFiles(s.keepDir, fp.Files[k:k+1], fp.ids[k:k+1])
	if err != nil {
		return err
	}
	defer closeAll(fs)
	testhook.HoldWhilePausing()
	if err := testhook.Fault("store"); err != nil {
		return err
	}
	if s.opts.Dedup == nil {
		return put(ctx, fp.Files[k], ctxReader{ctx, fs[0]})
	}
	st, err := fs[0].Stat()
	if err != nil {
		return err
	}
	cp := s.opts.Dedup.Cuts
	f := newFileCuts(ctx, fp.composer(), k, fs[0], st.Size(), cp)
	if cp != nil {
		err = cp.Put(ctx, fp.Files[k], f.all)
	} else {
		next, stop := iter.Pull2(iter.Seq2[Cut, error](f.all))
		err = put(ctx, fp.Files[k], &cutsReader{next: next})
		stop()
	}
	if err == nil {
		err = f.check()
	}
	fp.perFile[k] = f.hashed()
	return err
}

// storeHashes puts fp's BlockHashes, gathered from its files' composers.
func (s *FastSuspension) storeHashes(ctx context.Context, put PutFunc, fp *fastProc) error {
	if ctx.Err() != nil {
		return nil // a file failed: the store did
	}
	b, err := newBlockHashes(fp.key, len(fp.Files), fp.perFile).MarshalBinary()
	if err != nil {
		return err
	}
	return put(ctx, fp.Hashes, bytes.NewReader(b))
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

// Wait waits for the store that StartStore started and returns its error
// (the first file that failed); call it before the capture's commit, once
// the copy out has ended. If ctx ends first, the store is cancelled (and
// waited for). Again: the same answer.
func (s *FastSuspension) Wait(ctx context.Context) error {
	if s == nil || s.store == nil {
		return nil
	}
	st := s.store
	select {
	case <-st.done:
	case <-ctx.Done():
		st.cancel(context.Cause(ctx))
		st.close()
		<-st.done
	}
	return st.err
}

// StoreTime is how long the store took (after Wait), and when its first
// file began, both from StartStore (right before the copy out): it ran
// beside the copy out, the driver's checkpoint and CRIU's dump.
func (s *FastSuspension) StoreTime() (took, first time.Duration) {
	if s == nil || s.store == nil {
		return 0, 0
	}
	<-s.store.done
	return s.store.dur, max(s.store.first, 0)
}
