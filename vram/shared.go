package vram

// Device memory shared between the processes of a tree (NCCL's P2P
// transport: each rank maps buffers of the others, through shareable
// handles). The driver cannot checkpoint a process that maps another's
// memory, so the libraries release imports with the rest; the imported
// handle is the exporter's memory, never copied. Which export an import
// came from is found while both are alive, before the release: the
// libraries hold a duplicate of every descriptor exported or imported,
// and the two of a pair are one open file (kcmp). Each importer records
// the match (`source`, in its own memory: it survives CRIU). After the
// exporters are refilled, each exporter exports its new handle, gpucr-stream
// takes the descriptor (pidfd_getfd) and hands it to the importer, which
// imports and maps it where the old one was; only then does the importer
// run (Reimport).

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/preloadctl"
)

// ErrSharedOutside says a process maps device memory that no process of
// its tree exported: it cannot be recreated.
var ErrSharedOutside = errors.New("device memory imported from outside the tree")

const kcmpFile = 0

// sameFile says whether descriptor fa of pid a and fb of pid b are one
// open file.
func sameFile(a, fa, b, fb int) (bool, error) {
	r, _, e := unix.Syscall6(unix.SYS_KCMP, uintptr(a), uintptr(b), kcmpFile, uintptr(fa), uintptr(fb), 0)
	if e != 0 {
		return false, os.NewSyscallError("kcmp", e)
	}
	return r == 0, nil
}

// MatchShared records in every importer, parked, where each of its
// imports came from. Nothing to revert: the record is the importer's, for
// Reimport.
func (s *FastSuspension) MatchShared(ctx context.Context) error {
	type desc struct {
		fp    *fastProc
		h, fd int
	}
	var exports, imports []desc
	for _, fp := range s.procs {
		sh, err := fp.p.Shared(ctx)
		if err != nil {
			return fmt.Errorf("fast path: %w", err)
		}
		for _, d := range sh.Descriptors {
			if d.Import {
				imports = append(imports, desc{fp, d.H, d.FD})
			} else {
				exports = append(exports, desc{fp, d.H, d.FD})
			}
		}
	}
	for _, im := range imports {
		var from *desc
		for i, ex := range exports {
			same, err := sameFile(im.fp.PID, im.fd, ex.fp.PID, ex.fd)
			if err != nil {
				return fmt.Errorf("fast path: match process %d's imports: %w", im.fp.PID, err)
			}
			if same {
				from = &exports[i]
				break
			}
		}
		if from == nil {
			return fmt.Errorf("fast path: process %d: %w (its descriptor matches no export of the tree's processes)", im.fp.PID, ErrSharedOutside)
		}
		if err := im.fp.p.Source(ctx, im.h, from.fp.PID, from.h); err != nil {
			return fmt.Errorf("fast path: %w", err)
		}
	}
	return nil
}

// Reimport maps again, in every process of pids that waits for it (its
// own memory refilled, parked), the memory it imported from the others,
// from their new handles, and lets it run. Exporters must be refilled
// first. A process it cannot finish stays parked. What a process says it
// imported from is believed only for another process of pids with the
// same owner: root hands the importer a descriptor of the exporter's
// memory, and a process may say anything.
func Reimport(ctx context.Context, dir string, pids []int) error {
	var errs []error
	for _, pid := range pids {
		if err := reimportOne(ctx, dir, pid, pids); err != nil {
			errs = append(errs, fmt.Errorf("process %d: %w (it stays parked)", pid, err))
		}
	}
	return errors.Join(errs...)
}

func reimportOne(ctx context.Context, dir string, pid int, tree []int) error {
	if !preloadctl.Loaded(pid) {
		return nil
	}
	p, err := preloadctl.Dial(ctx, dir, pid)
	if err != nil {
		return err
	}
	defer p.Close()
	sh, err := p.Shared(ctx)
	if err != nil || !sh.Pending() {
		return err
	}
	// One connection and one pidfd for each exporter, held for all its
	// handles: NCCL's ranks import dozens of buffers of each other.
	exporters := map[int]*exporter{pid: {conn: p, pid: pid}}
	defer func() {
		for _, ex := range exporters {
			ex.close(p)
		}
	}()
	for _, im := range sh.Imports {
		if im.Present {
			continue
		}
		if im.SrcPID <= 0 || !slices.Contains(tree, im.SrcPID) || !preloadctl.SameOwner(pid, im.SrcPID) {
			return fmt.Errorf("import of handle record %d from process %d: %w (not matched at the checkpoint, or not of this tree and owner)", im.H, im.SrcPID, ErrSharedOutside)
		}
		ex := exporters[im.SrcPID]
		if ex == nil {
			conn, err := preloadctl.Dial(ctx, dir, im.SrcPID)
			if err != nil {
				return fmt.Errorf("import from process %d: %w", im.SrcPID, err)
			}
			ex = &exporter{conn: conn, pid: im.SrcPID}
			exporters[im.SrcPID] = ex
		}
		f, err := ex.export(ctx, im.SrcH)
		if err != nil {
			return fmt.Errorf("import from process %d: %w", im.SrcPID, err)
		}
		err = p.Import(ctx, im.H, f)
		f.Close()
		if err != nil {
			return err
		}
	}
	return p.Unpark(ctx)
}

// exporter is a process whose handles an importer maps again: its
// library's connection (the importer's own when it imports from itself: a
// library answers one connection at a time) and its pidfd.
type exporter struct {
	conn *preloadctl.Conn
	pid  int
	pfd  int // 0 until opened
}

// export has the exporter export its handle record h and takes the
// descriptor.
func (ex *exporter) export(ctx context.Context, h int) (*os.File, error) {
	fd, err := ex.conn.Export(ctx, h)
	if err != nil {
		return nil, err
	}
	if ex.pfd <= 0 {
		if ex.pfd, err = unix.PidfdOpen(ex.pid, 0); err != nil {
			ex.pfd = 0
			return nil, os.NewSyscallError("pidfd_open", err)
		}
	}
	mine, err := unix.PidfdGetfd(ex.pfd, fd, 0)
	if err != nil {
		return nil, os.NewSyscallError("pidfd_getfd", err)
	}
	return os.NewFile(uintptr(mine), fmt.Sprintf("export-%d-%d", ex.pid, h)), nil
}

// close closes what the exporter holds, but not the importer's own
// connection (held).
func (ex *exporter) close(held *preloadctl.Conn) {
	if ex.conn != held {
		ex.conn.Close()
	}
	if ex.pfd > 0 {
		unix.Close(ex.pfd)
	}
}
