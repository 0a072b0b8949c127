package gpuckpt

// The fill (issue 36, item 5; preload/fill.c has the design): a restore
// fills the fast path's device memory while CRIU restores, instead of
// after the driver's restore. For each fast-path process whose checkpoint
// holds a handle table, a filler (this binary's `gpu fill`, which loads
// the library) makes the process's handles on the GPU it is restored onto
// and copies its VRAM files in, all at once, straight from the archive
// behind CRIU's reads (a file the stage is already reading from the
// stage); then it exports the handles, and
// FastResume has the restored process adopt them in place of its remap and
// copy in. The fill only ever saves time: a filler that fails, or memory
// the process will not adopt, leaves the ordinary remap and copy in to do
// the work, and its reason is in the phases.

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/knobs"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/vram"
)

// Fill is the fillers of one restore.
type Fill struct {
	cancel context.CancelCauseFunc
	wg     sync.WaitGroup
	procs  map[int]*filling
}

type filling struct {
	done   chan struct{} // closed when run ends
	filled *vram.Filled
	err    error
	took   time.Duration
	cmd    *exec.Cmd
	conn   *preloadctl.Conn
	stderr limitedBuffer // the filler's, written while it runs
}

// StartFill starts, with GPUCR_FILL=1, a filler for each of procs'
// fast-path processes whose checkpoint (src) holds a handle table, onto
// the GPUs pairs move them to; gpus are the checkpoint's records of the
// device memory each process used. Close it after FastRestore; a nil Fill (nothing to fill) is closed
// too.
func StartFill(ctx context.Context, src source.Source, stage *Stage, procs []manifest.CUDAProcess, gpus []manifest.GPU, pairs []cudadriver.GPUPair) *Fill {
	if !knobs.Fill.On() {
		return nil
	}
	f := &Fill{procs: map[int]*filling{}}
	ctx, f.cancel = context.WithCancelCause(context.WithoutCancel(ctx))
	// Files the stage has not begun come from the archive behind CRIU's
	// reads, all at once (4 fetchers each, as the stage's).
	behind := src
	if a := location.ArchiveOf(src); a != nil {
		behind = a.Behind(4, 2*4*vram.DefaultFiles)
	}
	for _, p := range procs {
		if p.Path != manifest.CUDAPathPreload || p.Handles == "" {
			continue
		}
		fl := &filling{done: make(chan struct{})}
		f.procs[p.PID] = fl
		f.wg.Go(func() {
			defer close(fl.done)
			t := time.Now()
			fl.filled, fl.err = fl.run(ctx, src, behind, stage, p, gpus, pairs)
			fl.took = time.Since(t)
		})
	}
	if len(f.procs) == 0 {
		f.cancel(nil)
		return nil
	}
	return f
}

// Take waits for pid's filler and returns what it filled: nil if it has
// none, or it failed (Phases says why).
func (f *Fill) Take(ctx context.Context, pid int) *vram.Filled {
	if f == nil || f.procs[pid] == nil {
		return nil
	}
	fl := f.procs[pid]
	select {
	case <-fl.done:
	case <-ctx.Done():
		return nil
	}
	return fl.filled
}

// Phases say how long the slowest filler took, and why any failed.
func (f *Fill) Phases() []Phase {
	if f == nil {
		return nil
	}
	var ps []Phase
	var slowest time.Duration
	for pid, fl := range f.procs {
		select {
		case <-fl.done:
		default:
			continue
		}
		slowest = max(slowest, fl.took)
		if fl.err != nil {
			ps = append(ps, Phase{fmt.Sprintf("vram fill of %d failed (copied in after the driver's restore instead): %v", pid, fl.err), fl.took.Seconds()})
		}
	}
	return append([]Phase{{"vram fill (beside criu restore)", slowest.Seconds()}}, ps...)
}

// Close ends the fillers (what they exported stays alive in the processes
// that adopted it) and closes what they handed over.
func (f *Fill) Close() {
	if f == nil {
		return
	}
	f.cancel(errors.New("fill closed"))
	f.wg.Wait()
	for _, fl := range f.procs {
		fl.end()
		if fl.filled != nil {
			fl.filled.Table.Close()
			for _, h := range fl.filled.Handles {
				h.Close()
			}
		}
	}
}

// end closes the filler's socket, which ends it, and waits for it.
func (fl *filling) end() {
	if fl.conn != nil {
		fl.conn.Close()
		fl.conn = nil
	}
	if fl.cmd != nil {
		_ = fl.cmd.Wait()
		fl.cmd = nil
	}
}

// run fills process p's memory: the table, the filler, the copy in, the
// export.
func (fl *filling) run(ctx context.Context, src, behind source.Source, stage *Stage, p manifest.CUDAProcess, gpus []manifest.GPU, pairs []cudadriver.GPUPair) (*vram.Filled, error) {
	table, err := readTable(ctx, src, p.Handles, pairs)
	if err != nil {
		return nil, err
	}
	filled := &vram.Filled{Table: table}
	ok := false
	defer func() {
		if !ok {
			fl.end()
			table.Close()
			for _, h := range filled.Handles {
				h.Close()
			}
		}
	}()
	if err := fl.start(p.PID); err != nil {
		return nil, err
	}
	// The driver's restore of the process needs room for what it held
	// beyond its handles (its context, its other memory): the fill
	// leaves that free, and a margin, or does not run.
	var used int64
	for _, g := range gpus {
		if g.PID == p.PID {
			used += g.Bytes
		}
	}
	n, _, err := fl.conn.FillTable(ctx, table, used, fillMargin)
	if err != nil {
		return nil, fl.why(err)
	}
	// Every file at once: one the stage is reading comes from there when
	// it is read, the others (which the stage then leaves) straight from
	// the archive.
	get := func(ctx context.Context, name string, w io.Writer) error {
		f, err := stage.Take(ctx, name)
		if err != nil || f == nil {
			_, err := behind.Copy(ctx, name, w)
			return err
		}
		return spliceFile(w, f)
	}
	if filled.Copy, err = vram.CopyIn(ctx, fl.conn, p.Files, get, nil); err != nil {
		return nil, fl.why(err)
	}
	if filled.Handles, err = fl.export(ctx, n); err != nil {
		return nil, fl.why(err)
	}
	ok = true
	return filled, nil
}

// fillerCommand is the filler: this binary's `gpu fill` (tests run
// theirs).
var fillerCommand = func() (*exec.Cmd, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	return exec.Command(exe, "gpu", "fill"), nil
}

// start starts the filler, its socket on its descriptor 3, with every GPU
// visible (the table names them by UUID).
func (fl *filling) start(pid int) error {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("filler socket: %w", err)
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "filler"), os.NewFile(uintptr(fds[1]), "filler")
	defer theirs.Close()
	defer ours.Close() // FileConn dups it
	cmd, err := fillerCommand()
	if err != nil {
		return err
	}
	cmd.ExtraFiles = []*os.File{theirs}
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, "CUDA_VISIBLE_DEVICES=") {
			cmd.Env = append(cmd.Env, e)
		}
	}
	fl.stderr.n = 4096
	cmd.Stderr = &fl.stderr
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start the filler: %w", err)
	}
	fl.cmd = cmd
	c, err := net.FileConn(ours)
	if err != nil {
		return err
	}
	fl.conn = preloadctl.FillerConn(c.(*net.UnixConn), pid)
	return nil
}

// export takes the n handles the filler exports (pidfd_getfd).
func (fl *filling) export(ctx context.Context, n int) ([]*os.File, error) {
	pfd, err := unix.PidfdOpen(fl.cmd.Process.Pid, 0)
	if err != nil {
		return nil, os.NewSyscallError("pidfd_open", err)
	}
	defer unix.Close(pfd)
	var hs []*os.File
	for len(hs) < n {
		nums, err := fl.conn.FillExport(ctx, len(hs))
		if err == nil && len(nums) == 0 {
			err = fmt.Errorf("export from row %d of %d: none", len(hs), n)
		}
		for _, k := range nums {
			mine, gerr := unix.PidfdGetfd(pfd, k, 0)
			if gerr != nil {
				err = os.NewSyscallError("pidfd_getfd", gerr)
				break
			}
			hs = append(hs, os.NewFile(uintptr(mine), "handle"))
		}
		if err != nil {
			for _, h := range hs {
				h.Close()
			}
			return nil, err
		}
	}
	return hs, nil
}

// why adds what the filler said on its stderr to err.
func (fl *filling) why(err error) error {
	if s := strings.TrimSpace(fl.stderr.String()); s != "" {
		return fmt.Errorf("%w (filler: %s)", err, s)
	}
	return err
}

// fillMargin is device memory a fill leaves free beyond what the
// driver's restore of the process takes.
const fillMargin = 1 << 30

// readTable reads p's handle table from src into a memfd, its d rows
// naming the GPUs pairs move the process to.
func readTable(ctx context.Context, src source.Source, name string, pairs []cudadriver.GPUPair) (*os.File, error) {
	b := limitedBuffer{n: preloadctl.MaxHandleTable, fail: true}
	if _, err := src.Copy(ctx, name, &b); err != nil {
		return nil, fmt.Errorf("handle table %s: %w", name, err)
	}
	lines := strings.SplitAfter(b.String(), "\n")
	for i, l := range lines {
		ord, id, ok := strings.Cut(strings.TrimSuffix(strings.TrimPrefix(l, "d "), "\n"), " ")
		if !strings.HasPrefix(l, "d ") || !ok {
			continue
		}
		for _, p := range pairs {
			if hex.EncodeToString(p.Old[:]) == id {
				lines[i] = "d " + ord + " " + hex.EncodeToString(p.New[:]) + "\n"
			}
		}
	}
	fd, err := unix.MemfdCreate("gpucr-handles", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("handle table: memfd: %w", err)
	}
	f := os.NewFile(uintptr(fd), "gpucr-handles")
	if _, err := f.WriteString(strings.Join(lines, "")); err != nil {
		f.Close()
		return nil, fmt.Errorf("handle table: %w", err)
	}
	return f, nil
}

// spliceFile copies the staged file f into w, a pipe: spliced (the
// pipe takes f's pages) where it can be.
func spliceFile(w io.Writer, f *os.File) error {
	if p, ok := w.(*os.File); ok {
		var off int64
		for {
			n, err := unix.Splice(int(f.Fd()), &off, int(p.Fd()), nil, 1<<20, unix.SPLICE_F_MOVE|unix.SPLICE_F_MORE)
			if n == 0 && err == nil {
				return nil
			}
			if err == unix.EINTR || err == unix.EAGAIN {
				continue
			}
			if err != nil {
				if off == 0 && err == unix.EINVAL {
					break // no splice here: copy
				}
				return fmt.Errorf("splice: %w", err)
			}
		}
	}
	_, err := io.CopyBuffer(w, io.NewSectionReader(f, 0, 1<<62), make([]byte, 1<<20))
	return err
}

// limitedBuffer keeps the first n bytes written to it; with fail, more is
// an error. It may be read while written.
type limitedBuffer struct {
	mu   sync.Mutex
	b    bytes.Buffer
	n    int
	fail bool
}

func (l *limitedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if room := l.n - l.b.Len(); len(p) > room {
		if l.fail {
			return 0, fmt.Errorf("longer than %d bytes", l.n)
		}
		l.b.Write(p[:max(room, 0)])
		return len(p), nil
	}
	return l.b.Write(p)
}

func (l *limitedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
