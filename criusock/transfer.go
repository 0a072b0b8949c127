package criusock

// PushFiles and PullFiles are the whole producer side for files on disk
// (what `gpucr-stream vram push|pull` does): wait for the socket, move
// several files at once over one connection, and never leave a half-pulled
// file under its name.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"
)

// TransferFile is one image file of a push or pull: Name in the image,
// Path on disk, or "-" for Stdio.
type TransferFile struct {
	Name, Path string
}

// TransferOptions are a push's or pull's.
type TransferOptions struct {
	// Dir is the images dir of the capture (push) or serve (pull).
	Dir string
	// Producer names this producer to the capture or serve.
	Producer string
	// Wait is how long to wait for the socket to appear: a producer
	// started beside the capture may come first.
	Wait time.Duration
	// Stdio is where "-" reads from (push) or writes to (pull).
	Stdin  io.Reader
	Stdout io.Writer
}

// PushFiles sends files into a running capture (before CRIU's dump ends);
// if one fails, the connection is aborted so that the checkpoint does not
// complete without it. It returns the bytes sent.
func PushFiles(ctx context.Context, o TransferOptions, files []TransferFile) (int64, error) {
	cl, err := dialWait(ctx, o, CaptureSocket, DialProducer)
	if err != nil {
		return 0, err
	}
	n, err := each(files, func(f TransferFile) (int64, error) { return pushOne(ctx, cl, o.Stdin, f) })
	if err != nil {
		cl.Abort()
		return n, err
	}
	return n, cl.Close()
}

// PullFiles takes files from a running serve. It returns the bytes taken.
func PullFiles(ctx context.Context, o TransferOptions, files []TransferFile) (int64, error) {
	cl, err := dialWait(ctx, o, ServeSocket, DialPull)
	if err != nil {
		return 0, err
	}
	n, err := each(files, func(f TransferFile) (int64, error) { return pullOne(ctx, cl, o.Stdout, f) })
	if err != nil {
		cl.Close()
		return n, err
	}
	return n, cl.Close()
}

// dialWait dials sock in o.Dir, waiting up to o.Wait for it to appear and
// accept.
func dialWait(ctx context.Context, o TransferOptions, sock string, dial func(ctx context.Context, dir, name string) (*Client, error)) (*Client, error) {
	var cl *Client
	var err error
	for deadline := time.Now().Add(o.Wait); ; {
		if _, serr := os.Stat(filepath.Join(o.Dir, sock)); serr == nil {
			cl, err = dial(ctx, o.Dir, o.Producer)
			if err == nil || !errors.Is(err, syscall.ECONNREFUSED) {
				return cl, err
			}
		} else {
			err = fmt.Errorf("no %s in %s: is a capture or checkpoint (serve or restore for pull) running there?", sock, o.Dir)
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return nil, err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// each runs fn for every file at once and sums the bytes.
func each(files []TransferFile, fn func(TransferFile) (int64, error)) (int64, error) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	var total int64
	for _, f := range files {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n, err := fn(f)
			mu.Lock()
			defer mu.Unlock()
			total += n
			if err != nil {
				errs = append(errs, err)
			}
		}()
	}
	wg.Wait()
	return total, errors.Join(errs...)
}

func pushOne(ctx context.Context, cl *Client, stdin io.Reader, f TransferFile) (int64, error) {
	r := stdin
	if f.Path != "-" {
		file, err := os.Open(f.Path)
		if err != nil {
			return 0, err
		}
		defer file.Close()
		r = file
	}
	cr := &countReader{r: r}
	err := cl.Push(ctx, f.Name, cr)
	return cr.n, err
}

// pullOne writes into a temporary file renamed into place once whole.
func pullOne(ctx context.Context, cl *Client, stdout io.Writer, f TransferFile) (int64, error) {
	if f.Path == "-" {
		return cl.Pull(ctx, f.Name, stdout)
	}
	tmp, err := os.CreateTemp(filepath.Dir(f.Path), "."+filepath.Base(f.Path)+".partial-*")
	if err != nil {
		return 0, err
	}
	n, err := cl.Pull(ctx, f.Name, tmp)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), f.Path)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return n, err
	}
	return n, nil
}

type countReader struct {
	r io.Reader
	n int64
}

func (c *countReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.n += int64(n)
	return n, err
}
