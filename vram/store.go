package vram

// The store: after the release, the kept files go into the checkpoint
// (put, the capture), beside the driver's checkpoint and CRIU's dump; the
// caller waits for it before the commit.

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

// StartStore stores every kept file into put, all at once (the capture
// bounds its memory), and returns: the store runs on until Wait, StopStore
// or Commit. The first failure cancels the others. Never fails.
func (s *FastSuspension) StartStore(ctx context.Context) error {
	s.startStore(ctx, s.put)
	testhook.Pause(context.Background(), "released")
	return nil
}

// StopStore cancels a store still running (the undo of StartStore): it
// ends at its next read. RemoveKeep waits for it.
func (s *FastSuspension) StopStore(context.Context) error {
	if s.stopStore != nil {
		s.stopStore(ErrUndone)
	}
	return nil
}

// startStore starts the store of every kept file into put.
func (s *FastSuspension) startStore(parent context.Context, put PutFunc) {
	ctx, cancel := context.WithCancelCause(parent)
	s.stopStore, s.storeDone = cancel, make(chan struct{})
	start := time.Now()
	var wg sync.WaitGroup
	var failed atomic.Bool
	fail := func(fp *fastProc, name string, err error) {
		failed.Store(true)
		cancel(fmt.Errorf("process %d: store %s: %w", fp.PID, name, err))
	}
	for _, fp := range s.procs {
		var files sync.WaitGroup
		fp.perFile = make([][]hashedPiece, len(fp.Files))
		for k, name := range fp.Files {
			wg.Add(1)
			files.Add(1)
			go func() {
				defer wg.Done()
				defer files.Done()
				if err := s.storeFile(ctx, put, fp, k); err != nil {
					fail(fp, name, err)
				}
			}()
		}
		if fp.Handles != "" {
			wg.Go(func() {
				if err := put(ctx, fp.Handles, bytes.NewReader(fp.handles)); err != nil {
					fail(fp, fp.Handles, err)
				}
			})
		}
		if s.opts.Dedup != nil {
			// Its block hashes, once every file has gone by.
			wg.Go(func() {
				files.Wait()
				if err := s.storeHashes(ctx, put, fp); err != nil {
					fail(fp, fp.Hashes, err)
				}
			})
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
		m := mapKept(ctx, fs[0])
		if m == nil {
			return put(ctx, fp.Files[k], ctxReader{ctx, fs[0]})
		}
		defer m.unmap() // put has returned: nothing lent is referenced
		return put(ctx, fp.Files[k], m)
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
	return s.storeErr
}

// StoreTime is how long the store took (after Wait): it ran beside the
// driver's checkpoint and CRIU's dump.
func (s *FastSuspension) StoreTime() time.Duration {
	if s == nil || s.storeDone == nil {
		return 0
	}
	<-s.storeDone
	return s.storeDur
}
