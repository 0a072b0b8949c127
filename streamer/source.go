package streamer

import (
	"context"
	"fmt"
	"io"
	"sync"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
)

// Source serves the files of one checkpoint, whatever it is read from.
type Source interface {
	// Stat waits until the named file is known and complete, then returns
	// its entry; an error wrapping errdefs.ErrNotFound means the image lacks it.
	Stat(ctx context.Context, name string) (manifest.File, error)
	// Copy writes the whole file to w, every chunk checked before it is
	// written. It may be called more than once for a file.
	Copy(ctx context.Context, name string, w io.Writer) (int64, error)
	// Files waits until the whole checkpoint is known and lists it.
	Files(ctx context.Context) ([]manifest.File, error)
	// Close releases buffers and temporary files.
	Close() error
}

// decodeChunk decodes payload into dst (len == raw length) and checks the
// raw checksum: the one place every restored byte is verified.
func decodeChunk(dst []byte, codecID uint8, checksum uint32, payload []byte) error {
	if codec.ID(codecID) == codec.None {
		// Stored raw: dst may be payload itself.
		if len(payload) != len(dst) {
			return fmt.Errorf("raw chunk of %d bytes, want %d: %w", len(payload), len(dst), errdefs.ErrCorrupt)
		}
		if len(dst) > 0 && &dst[0] != &payload[0] {
			copy(dst, payload)
		}
	} else if err := codec.Decode(codec.ID(codecID), dst, payload); err != nil {
		return fmt.Errorf("decode %s chunk: %v: %w", codec.ID(codecID), err, errdefs.ErrCorrupt)
	}
	if got := codec.Checksum(dst); got != checksum {
		return fmt.Errorf("checksum mismatch after decoding (stored %08x, computed %08x): %w", checksum, got, errdefs.ErrCorrupt)
	}
	return nil
}

// zeros is shared by every writer of zero chunks.
var zeros = make([]byte, 1<<20)

func writeZeros(w io.Writer, n int64) error {
	return zeroRuns(zeros, n, func(b []byte) error { _, err := w.Write(b); return err })
}

// zeroRuns hands n zero bytes to write in pieces of z, which is all zeros.
func zeroRuns(z []byte, n int64, write func([]byte) error) error {
	for n > 0 {
		k := min(n, int64(len(z)))
		if err := write(z[:k]); err != nil {
			return err
		}
		n -= k
	}
	return nil
}

// ordered runs fetch(i) for i in [0,n) on up to `parallel` goroutines and
// hands results to emit in index order, keeping at most `window` results
// ready ahead of emit. It returns the first error; all goroutines it
// started have returned by then.
func ordered[T any](ctx context.Context, n, parallel, window int, fetch func(context.Context, int) (T, error), emit func(int, T) error, drop func(T)) error {
	if n == 0 {
		return nil
	}
	window = max(1, min(window, n))
	parallel = max(1, min(parallel, window))
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	type result struct {
		v   T
		err error
	}
	slots := make([]chan result, n)
	for i := range slots {
		slots[i] = make(chan result, 1)
	}
	// credits bounds results fetched but not yet emitted.
	credits := make(chan struct{}, window)
	next := make(chan int)
	var wg sync.WaitGroup
	wg.Add(1 + parallel)
	go func() {
		defer wg.Done()
		defer close(next)
		for i := range n {
			select {
			case credits <- struct{}{}:
			case <-ctx.Done():
				return
			}
			select {
			case next <- i:
			case <-ctx.Done():
				<-credits
				return
			}
		}
	}()
	for range parallel {
		go func() {
			defer wg.Done()
			for i := range next {
				v, err := fetch(ctx, i)
				slots[i] <- result{v, err}
			}
		}()
	}
	var err error
	for i := 0; i < n && err == nil; i++ {
		select {
		case r := <-slots[i]:
			if r.err != nil {
				err = r.err
				break
			}
			err = emit(i, r.v)
			drop(r.v)
			<-credits
		case <-ctx.Done():
			err = context.Cause(ctx)
		}
	}
	cancel(err)
	wg.Wait()
	// Results fetched after the failure still hold buffers.
	for i := range slots {
		select {
		case r := <-slots[i]:
			if r.err == nil {
				drop(r.v)
			}
		default:
		}
	}
	return err
}
