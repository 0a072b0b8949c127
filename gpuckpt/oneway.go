package gpuckpt

// What the driver cannot undo. A checkpoint locks and checkpoints the CUDA
// processes of a tree, and undoes both when anything fails later (CRIU,
// the store). For some processes the undo does not exist: on driver 580
// cuCheckpointProcessRestore answers CUDA_ERROR_NOT_SUPPORTED for an NCCL
// rank it checkpointed, and locking one rank leaves the other's lock
// answering CUDA_ERROR_NOT_READY (its collective waits for the locked
// rank), so a failure halfway leaves the whole job frozen on the GPU. The
// same holds for device memory one process maps from another (IPC
// handles, shareable handles). Such a tree is refused before the first
// lock, the job untouched.
//
// What tells: the preload library's report, where the process runs under
// `gpucr-stream run` (it marks a process that exported or imported device
// memory); and /proc for every process: libnccl mapped together with a
// sign of a live communicator (NCCL's /dev/shm segments, its abstract
// unix sockets "@/tmp/nccl-socket-RANK-HASH", threads named "NCCL ...",
// or a TCP connection to another NCCL process of the tree: the
// bootstrap). libnccl alone is not enough: every PyTorch process with CUDA
// maps it, and one without a communicator checkpoints like any other.

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/testhook"
)

// ErrOneWay says a tree was refused before any GPU step: the driver could
// not undo that step for one of its processes.
var ErrOneWay = errors.New("the CUDA driver cannot undo a checkpoint of this tree")

// sharedCalls are the driver calls after which the preload library says a
// process shares device memory with another (preload/wrappers.c,
// INCAPABLE_LIST; the importer of a legacy IPC handle is not seen, its
// exporter is).
var sharedCalls = []string{"cuIpcGetMemHandle", "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle"}

// oneWay is why the driver could not undo one process's checkpoint.
type oneWay struct {
	pid  int
	nccl bool     // an NCCL rank
	why  []string // what shows it
	// preloaded: the process runs with the library (what it reports is
	// exact).
	preloaded bool
}

// findOneWay lists the processes of pids whose GPU step the driver could
// not undo.
func findOneWay(ctx context.Context, pids []int) []oneWay {
	ncclLib, ncclShm := map[int]string{}, map[int]string{}
	for _, pid := range pids {
		for _, f := range proc.MappedFiles(pid) {
			if b := filepath.Base(f); ncclLib[pid] == "" && strings.HasPrefix(b, "libnccl") && strings.Contains(b, ".so") {
				ncclLib[pid] = b
			}
			if ncclShm[pid] == "" && strings.HasPrefix(f, "/dev/shm/nccl-") {
				ncclShm[pid] = f
			}
		}
	}
	// Loopback TCP between two NCCL processes of the tree: NCCL's
	// bootstrap ring and proxy connections.
	conns := proc.EstablishedTCP(pids)
	owner := map[string]int{}
	for _, c := range conns {
		owner[c.Local] = c.PID
	}
	var out []oneWay
	for _, pid := range pids {
		w := oneWay{pid: pid, preloaded: preloadctl.Loaded(pid)}
		if w.preloaded {
			if call := preloadShared(ctx, pid); call != "" {
				w.why = append(w.why, "the preload library saw it call "+call)
			}
		}
		if lib := ncclLib[pid]; lib != "" {
			var signs []string
			if f := ncclShm[pid]; f != "" {
				signs = append(signs, "maps NCCL's "+f)
			}
			for _, s := range proc.UnixSocketNames(pid) {
				if strings.Contains(s, "/nccl-socket-") {
					signs = append(signs, "holds NCCL's socket "+s)
					break
				}
			}
			for _, n := range proc.ThreadNames(pid) {
				if strings.HasPrefix(n, "NCCL ") {
					signs = append(signs, fmt.Sprintf("runs NCCL's thread %q", n))
					break
				}
			}
			var peers []int
			for _, c := range conns {
				if q, ok := owner[c.Remote]; ok && c.PID == pid && q != pid && ncclLib[q] != "" && !slices.Contains(peers, q) {
					peers = append(peers, q)
				}
			}
			if len(peers) > 0 {
				signs = append(signs, fmt.Sprintf("is connected over TCP to process %s, which maps libnccl too", joinInts(peers)))
			}
			if len(signs) > 0 {
				w.nccl = true
				w.why = append(append(w.why, "maps "+lib), signs...)
			}
		}
		if len(w.why) > 0 {
			out = append(out, w)
		}
	}
	return out
}

func preloadReport(ctx context.Context, pid int) (preloadctl.Report, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	p, err := preloadctl.Dial(ctx, preloadctl.Dir(), pid)
	if err != nil {
		return preloadctl.Report{}, err
	}
	defer p.Close()
	return p.Report(ctx)
}

// preloadShared asks pid's library which call made it share device
// memory ("" if none, or if the library does not answer in time).
func preloadShared(ctx context.Context, pid int) string {
	r, err := preloadReport(ctx, pid)
	if err != nil || r.Capable {
		return ""
	}
	for _, c := range sharedCalls {
		if strings.Contains(r.Reason, c) {
			return c
		}
	}
	return ""
}

// CheckUndoable refuses, before any GPU step, a tree whose CUDA processes
// pids hold what the driver cannot undo (see the top of this file): the
// error wraps ErrOneWay, names each process and what shows it, and the
// ways out. Nothing was touched. The GPU machine's fault round
// (GPUCR_TEST_FAULT=gpu-checkpoint) fails the driver's checkpoint before
// it reaches the driver: nothing is one way then, and nothing is refused.
//
// NCCL ranks whose device memory the fast path takes (fast: it is not
// off; every process of pids runs with the library and shares no device
// memory) are not refused: the fast path parks them at one collective
// boundary (preload/gate.c), moves their memory out itself, and the driver
// checkpoints and restores contexts that hold almost nothing (measured on
// driver 580 with NCCL 2.28.9, whose ranks then shared no memory: the
// driver's own checkpoint of the same ranks left them failing their next
// kernel, docs/bench-log/2026-11.md, "NCCL").
func CheckUndoable(ctx context.Context, pids []int, fast bool) error {
	if testhook.Fault("gpu-checkpoint") != nil {
		return nil
	}
	if fast {
		// The fast path's own check, within the refusal's 2 s.
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := fastCheck(cctx, pids)
		cancel()
		if err == nil {
			return nil
		}
	}
	ws := findOneWay(ctx, pids)
	if len(ws) == 0 {
		return nil
	}
	var parts []string
	nccl, unpreloaded := false, false
	for _, w := range ws {
		what := "shares device memory with another process"
		if w.nccl {
			what, nccl = "is an NCCL rank", true
		}
		unpreloaded = unpreloaded || !w.preloaded
		parts = append(parts, fmt.Sprintf("process %d %s (%s)", w.pid, what, strings.Join(w.why, "; ")))
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %s. ", strings.Join(parts, ", "), ErrOneWay)
	if nccl {
		b.WriteString("Driver 580 cannot restore an NCCL rank it checkpointed (CUDA_ERROR_NOT_SUPPORTED), and locking one rank stalls the others (CUDA_ERROR_NOT_READY)")
	} else {
		b.WriteString("The driver cannot restore device memory that another process maps")
	}
	b.WriteString(", so a failure on the way would leave the job frozen on the GPU for good. Refused before any GPU step: the job runs on, untouched. ")
	b.WriteString("Ways: stop the job once it has saved its own state and start it again")
	if unpreloaded {
		b.WriteString("; a job started under `gpucr-stream run` is seen exactly by the preload library, and takes the GPU fast path where its processes share no device memory")
	}
	return oneWayError(b.String())
}

// oneWayError is CheckUndoable's message; it wraps ErrOneWay.
type oneWayError string

func (e oneWayError) Error() string        { return string(e) }
func (e oneWayError) Is(target error) bool { return target == ErrOneWay }

func joinInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, ", ")
}
