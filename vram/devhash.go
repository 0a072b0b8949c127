package vram

// HashDevice measures the two ways of finding which device memory changed
// since a checkpoint (issue 22), on one process, in one park: hashing it
// on the device (the library's `devhash`, preload/devhash.c), and copying
// it out at bus speed (a checkpoint's copy out, into scratch files) and
// hashing the copy on the host's cores (BLAKE3, what a chunk's content id
// costs). The library keeps its last block hashes, so a second call says
// how much changed since the first.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/fsat"
	"github.com/gpucr/gpucr-stream/preloadctl"
)

// DefaultHashBlock is HashDevice's block: a deduplicated checkpoint's
// chunks of device memory are about 320 KiB, so a block of 64 KiB tells
// which of them changed.
const DefaultHashBlock = 64 << 10

// HashOptions configure HashDevice.
type HashOptions struct {
	Block int64  // bytes a block (0: DefaultHashBlock)
	Key   uint64 // the hash's key
	// Check hashes every block on the host too, in the library (one
	// thread), and counts the blocks whose hashes differ.
	Check bool
	// Scratch, when not nil, is a directory (held open) into which the
	// memory is also copied out, at bus speed, with Files copy threads
	// (0: DefaultFiles), and hashed there on every core.
	Scratch *os.File
	Files   int
	// ParkTimeout bounds the wait for CUDA calls in flight (0: 10 s).
	ParkTimeout time.Duration
}

// HashReport is what HashDevice measured.
type HashReport struct {
	PID   int     `json:"pid"`
	ParkS float64 `json:"park_s"`
	// Device is the library's answer.
	Device preloadctl.DevHash `json:"device"`
	// With a scratch directory: the copy out, and the host's hashing of
	// the copy on HostCores goroutines.
	CopyOutS   float64 `json:"copy_out_s,omitempty"`
	CopyBytes  int64   `json:"copy_bytes,omitempty"`
	HostHashS  float64 `json:"host_hash_s,omitempty"`
	HostCores  int     `json:"host_cores,omitempty"`
	HostHashed int64   `json:"host_hashed_bytes,omitempty"`
}

// HashDevice parks pid (one process: an NCCL rank parked alone would wait
// for its peers), hashes its device memory on the device and, with
// o.Scratch, copies it out and hashes the copy on the host, then unparks
// it.
func HashDevice(ctx context.Context, sockDir string, pid int, o HashOptions) (r HashReport, err error) {
	r.PID = pid
	if o.Block <= 0 {
		o.Block = DefaultHashBlock
	}
	if o.Files <= 0 {
		o.Files = DefaultFiles
	}
	if o.ParkTimeout <= 0 {
		o.ParkTimeout = 10 * time.Second
	}
	p, err := preloadctl.Dial(ctx, sockDir, pid)
	if err != nil {
		return r, fmt.Errorf("hash the device memory of %d: %w", pid, err)
	}
	defer p.Close()
	t := time.Now()
	if err := p.Park(ctx, o.ParkTimeout); err != nil {
		return r, fmt.Errorf("hash the device memory of %d: %w", pid, err)
	}
	r.ParkS = time.Since(t).Seconds()
	defer func() {
		if uerr := p.Unpark(context.WithoutCancel(ctx)); uerr != nil {
			err = errors.Join(err, fmt.Errorf("unpark %d: %w", pid, uerr))
		}
	}()
	if r.Device, err = p.DevHash(ctx, o.Block, o.Key, o.Check); err != nil {
		return r, fmt.Errorf("hash the device memory of %d: %w", pid, err)
	}
	if r.Device.MismatchedBlocks > 0 {
		return r, fmt.Errorf("hash the device memory of %d: the device's hashes of %d of %d blocks differ from the host's: %w",
			pid, r.Device.MismatchedBlocks, r.Device.Blocks, errdefs.ErrCorrupt)
	}
	if o.Scratch == nil {
		return r, nil
	}
	fs := make([]*os.File, 0, o.Files)
	defer func() { closeAll(fs) }()
	for range o.Files {
		f, err := fsat.CreateUnnamed(o.Scratch)
		if err != nil {
			return r, err
		}
		fs = append(fs, f)
	}
	t = time.Now()
	cs, err := p.CopyOut(ctx, fs)
	if err != nil {
		return r, fmt.Errorf("copy out %d: %w", pid, err)
	}
	r.CopyOutS, r.CopyBytes = time.Since(t).Seconds(), cs.Bytes
	t = time.Now()
	r.HostCores = runtime.GOMAXPROCS(0)
	if r.HostHashed, err = hashFiles(ctx, fs, r.HostCores); err != nil {
		return r, err
	}
	r.HostHashS = time.Since(t).Seconds()
	return r, nil
}

// hashFiles hashes the files in pieces of 1 MiB on workers goroutines, as
// content ids are computed, and returns the bytes hashed.
func hashFiles(ctx context.Context, fs []*os.File, workers int) (int64, error) {
	const piece = 1 << 20
	type job struct {
		f   *os.File
		off int64
	}
	jobs := make(chan job)
	var total atomic.Int64
	errs := make([]error, workers+1) // the workers', then the feed's
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, piece)
			for j := range jobs {
				if errs[w] != nil {
					continue
				}
				n, err := j.f.ReadAt(buf, j.off)
				if err != nil && err != io.EOF {
					errs[w] = err
					continue
				}
				codec.ContentHash(buf[:n])
				total.Add(int64(n))
			}
		}()
	}
feed:
	for _, f := range fs {
		st, err := f.Stat()
		if err != nil {
			errs[workers] = err
			break
		}
		for off := int64(0); off < st.Size(); off += piece {
			select {
			case jobs <- job{f, off}:
			case <-ctx.Done():
				break feed
			}
		}
	}
	close(jobs)
	wg.Wait()
	if err := errors.Join(append(errs, context.Cause(ctx))...); err != nil {
		return total.Load(), fmt.Errorf("hash the copy: %w", err)
	}
	return total.Load(), nil
}
