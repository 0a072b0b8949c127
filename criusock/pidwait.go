package criusock

// Restoring where the checkpoint was taken: CRIU forks each process of the
// image with its own PID and each thread with its own TID, and fails with
// "Can't fork for PID: File exists" where one is still taken, as it is
// right after the dump until the checkpointed process has been reaped by
// its parent. CRIU reads pstree.img before it forks anything, so the first
// read of pstree.img is where the PIDs are known and none is needed yet:
// the restore waits there, bounded, for them to be free, whatever the
// source (an archive, a stream, a receiver).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	pstreeimg "github.com/checkpoint-restore/go-criu/v7/crit/images/pstree"
	"google.golang.org/protobuf/proto"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/source"
)

const (
	pstreeFile  = "pstree.img"
	pstreeMagic = 0x50273030 // criu/include/magic.h
	// maxPstreeImg bounds what is read of pstree.img (a few dozen bytes a
	// process and four a thread).
	maxPstreeImg = 16 << 20
)

// DefaultFreePIDs is how long a restore waits for the PIDs it restores to
// be free when its options leave it zero.
const DefaultFreePIDs = 10 * time.Second

// ErrPIDTaken is a PID the checkpoint restores that stayed taken.
var ErrPIDTaken = errors.New("a PID the checkpoint restores is taken")

// pstreePIDs lists the PIDs and TIDs pstree.img restores, each once, in
// image order; ownNS says its root is PID 1, the init of a PID namespace
// of its own, whose PIDs are not this namespace's.
func pstreePIDs(img []byte) (pids []int, ownNS bool, err error) {
	seen := map[int]bool{}
	add := func(p uint32) {
		if !seen[int(p)] {
			seen[int(p)] = true
			pids = append(pids, int(p))
		}
	}
	err = imageEntries(img, pstreeMagic, func(raw []byte, off int) error {
		var e pstreeimg.PstreeEntry
		if err := proto.Unmarshal(raw, &e); err != nil {
			return fmt.Errorf("pstree entry at offset %d: %v: %w", off, err, errdefs.ErrCorrupt)
		}
		if len(pids) == 0 && e.GetPid() == 1 {
			ownNS = true
		}
		add(e.GetPid())
		for _, t := range e.GetThreads() {
			add(t)
		}
		return nil
	})
	return pids, ownNS, err
}

// freePIDs is a Source whose first read of pstree.img waits until the
// PIDs it restores are free.
type freePIDs struct {
	source.Source
	timeout time.Duration
	log     func(string)
	once    sync.Once
	err     error
	waited  time.Duration
}

// waitFreePIDs returns src, whose first read of pstree.img waits up to
// timeout (0: DefaultFreePIDs) until every PID and TID it restores is free
// here; one still taken then fails the read with ErrPIDTaken, naming it and
// its holder, and CRIU's restore fails before it forks. A damaged
// pstree.img is CRIU's to refuse.
func waitFreePIDs(src source.Source, timeout time.Duration, log func(string)) *freePIDs {
	if timeout == 0 {
		timeout = DefaultFreePIDs
	}
	return &freePIDs{Source: src, timeout: timeout, log: log}
}

// Waited is how long the read of pstree.img waited for the PIDs.
func (f *freePIDs) Waited() time.Duration { return f.waited }

// Manifest forwards what it wraps (source.Manifester).
func (f *freePIDs) Manifest() *manifest.Manifest { return source.ManifestOf(f.Source) }

// CopyToFile keeps the underlying source's faster copy where it has one.
func (f *freePIDs) CopyToFile(ctx context.Context, name string, file *os.File) (int64, error) {
	if name != pstreeFile {
		return source.CopyToFile(ctx, f.Source, name, file)
	}
	return f.Copy(ctx, name, file)
}

func (f *freePIDs) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	if name != pstreeFile {
		return f.Source.Copy(ctx, name, w)
	}
	img, err := readImage(ctx, f.Source, name, maxPstreeImg)
	if err != nil {
		return 0, err
	}
	f.once.Do(func() {
		start := time.Now()
		f.err = f.wait(ctx, img)
		f.waited = time.Since(start)
	})
	if f.err != nil {
		return 0, f.err
	}
	n, err := w.Write(img)
	return int64(n), err
}

// wait waits until the PIDs img restores are free.
func (f *freePIDs) wait(ctx context.Context, img []byte) error {
	pids, ownNS, err := pstreePIDs(img)
	if err != nil || ownNS {
		return nil
	}
	taken := func() []int {
		return slices.DeleteFunc(slices.Clone(pids), func(p int) bool { return !proc.Exists(p) })
	}
	left := taken()
	if len(left) == 0 {
		return nil
	}
	if f.log != nil {
		f.log(fmt.Sprintf("restore waits up to %v for PID %d, which the checkpoint restores, to be free: held by %s", f.timeout, left[0], proc.Holder(left[0])))
	}
	deadline := time.Now().Add(f.timeout)
	for ; len(left) > 0; left = taken() {
		if time.Now().After(deadline) {
			more := ""
			if len(left) > 1 {
				var ps []string
				for _, p := range left[1:min(len(left), 11)] {
					ps = append(ps, strconv.Itoa(p))
				}
				more = fmt.Sprintf(" (and %d more: %s)", len(left)-1, strings.Join(ps, ", "))
			}
			return fmt.Errorf("%w after %v: PID %d by %s%s; criu cannot restore the checkpoint here while it is (was it taken with --leave-running? stop that process, or restore on another host)",
				ErrPIDTaken, f.timeout, left[0], proc.Holder(left[0]), more)
		}
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-time.After(2 * time.Millisecond):
		}
	}
	return nil
}
