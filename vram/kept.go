package vram

// gpucr-stream's own record of the copy it kept of a process's device
// memory, so that `gpu resume --pid` (another gpucr-stream, after one that
// died) finds the copy without asking the process: it never opens a path
// the process names (the process's user may have it name a file of
// root's). One record per process in a directory that is ours alone
// (DefaultRecords), written before the release and removed with the
// copy. It names the kept copy's directory and files with their device
// and inode, which must match when they are opened again (through the
// directory's descriptor, package fsat); the process's start time tells
// a reused pid apart.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/gpucr/gpucr-stream/fsat"
	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/proc"
	"golang.org/x/sys/unix"
)

// DefaultRecords is the directory of the kept-copy records: root's under
// /run/gpucr-stream, anyone else's under $XDG_RUNTIME_DIR or $TMPDIR.
func DefaultRecords() string {
	if os.Geteuid() == 0 {
		return "/run/gpucr-stream/kept"
	}
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "gpucr-stream", "kept")
	}
	return filepath.Join(os.TempDir(), "gpucr-stream-"+strconv.Itoa(os.Geteuid()), "kept")
}

// keptRecord is what gpucr-stream kept of one process.
type keptRecord struct {
	PID   int       `json:"pid"`
	Start uint64    `json:"start"` // the process's start time (clock ticks after boot)
	Dir   string    `json:"dir"`
	DirID fsat.ID   `json:"dir_id"`
	Files []string  `json:"files"`
	IDs   []fsat.ID `json:"ids"`
	// Earlier (LOC/NAME) holds the blocks the kept files left out, which
	// the skip file Skip (in Dir) lists.
	Earlier string  `json:"earlier,omitempty"`
	Skip    string  `json:"skip,omitempty"`
	SkipID  fsat.ID `json:"skip_id,omitzero"`
}

// ErrNoRecord says gpucr-stream kept no copy of that process.
var ErrNoRecord = errors.New("gpucr-stream kept no copy of its device memory")

func recordName(pid int) string { return "process-" + strconv.Itoa(pid) + ".json" }

// startTime is field 22 of /proc/PID/stat.
func startTime(pid int) (uint64, error) {
	b, err := os.ReadFile(filepath.Join(proc.Root, strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, err
	}
	// The command name may hold spaces and parentheses: fields count from
	// the last ')'.
	i := strings.LastIndexByte(string(b), ')')
	f := strings.Fields(string(b[i+1:]))
	if i < 0 || len(f) < 20 {
		return 0, fmt.Errorf("%s/%d/stat: unexpected %q", proc.Root, pid, b)
	}
	return strconv.ParseUint(f[19], 10, 64)
}

// writeRecord writes r into dir (replacing an older record of that pid).
func writeRecord(dir string, r keptRecord) error {
	d, err := fsat.MkdirOwned(dir)
	if err != nil {
		return fmt.Errorf("record of the kept copy: %w", err)
	}
	defer d.Close()
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	tmp := recordName(r.PID) + ".tmp"
	fsat.RemoveAll(d, tmp)
	f, err := fsat.Create(d, tmp, unix.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("record of the kept copy: %w", err)
	}
	_, err = f.Write(b)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = unix.Renameat(int(d.Fd()), tmp, int(d.Fd()), recordName(r.PID))
	}
	if err != nil {
		return fmt.Errorf("record of the kept copy in %s: %w", dir, err)
	}
	return nil
}

// loadRecord reads the record of pid in dir, if it is of the process
// running as pid now.
func loadRecord(dir string, pid int) (keptRecord, error) {
	var r keptRecord
	d, err := fsat.OpenOwned(dir)
	if errors.Is(err, os.ErrNotExist) {
		return r, fmt.Errorf("process %d: %w (no record in %s)", pid, ErrNoRecord, dir)
	}
	if err != nil {
		return r, err
	}
	defer d.Close()
	r, err = readRecord(d, recordName(pid))
	if errors.Is(err, os.ErrNotExist) {
		return r, fmt.Errorf("process %d: %w (no record in %s)", pid, ErrNoRecord, dir)
	}
	if err != nil {
		return r, err
	}
	if !r.current() || r.PID != pid {
		return r, fmt.Errorf("process %d: %w (the record in %s is of another process)", pid, ErrNoRecord, dir)
	}
	return r, nil
}

func readRecord(d *os.File, name string) (keptRecord, error) {
	var r keptRecord
	f, err := fsat.Open(d, name, unix.O_RDONLY)
	if err != nil {
		return r, err
	}
	defer f.Close()
	if err := json.NewDecoder(f).Decode(&r); err != nil {
		return r, fmt.Errorf("%s: %w", f.Name(), err)
	}
	if len(r.Files) != len(r.IDs) || len(r.Files) == 0 || r.PID <= 0 {
		return r, fmt.Errorf("%s: a record without files", f.Name())
	}
	return r, nil
}

// current says whether the process r was kept for still runs.
func (r keptRecord) current() bool {
	st, err := startTime(r.PID)
	return err == nil && st == r.Start
}

// drop removes the copy r names and r itself (in dir).
func (r keptRecord) drop(dir string) {
	if kd, err := r.openDir(); err == nil {
		removeFiles(kd, r.Files, r.IDs)
		kd.Close()
	}
	removeRecord(dir, r.PID)
}

// sweepRecords drops the copies, and the records, that gpucr-stream runs
// that died kept of processes that are gone, and the older copy of a
// process about to be kept again (pid): the library refilled from it on
// its own, or the process was restored from its checkpoint meanwhile.
func sweepRecords(dir string, pids []int) {
	d, err := fsat.OpenOwned(dir)
	if err != nil {
		return
	}
	names, _ := fsat.Names(d)
	for _, name := range names {
		if !strings.HasPrefix(name, "process-") || !strings.HasSuffix(name, ".json") {
			continue
		}
		r, err := readRecord(d, name)
		if err == nil && name == recordName(r.PID) && (!r.current() || slices.Contains(pids, r.PID)) {
			r.drop(dir)
		}
	}
	d.Close()
}

// removeRecord removes the record of pid in dir.
func removeRecord(dir string, pid int) {
	if d, err := fsat.OpenOwned(dir); err == nil {
		fsat.RemoveAll(d, recordName(pid))
		d.Close()
	}
}

// openDir opens the kept copy's directory the record names: ours alone,
// and the very directory that was made for it.
func (r keptRecord) openDir() (*os.File, error) {
	d, err := fsat.OpenOwned(r.Dir)
	if err != nil {
		return nil, fmt.Errorf("kept copy: %w", err)
	}
	if id, err := fsat.IDOf(d); err != nil || id != r.DirID {
		d.Close()
		return nil, fmt.Errorf("kept copy: %s: %w: not the directory it was kept in", r.Dir, fsat.ErrUnsafe)
	}
	return d, nil
}

// openFiles opens the kept files beneath dir, read-only, each the very
// file written then.
func openFiles(dir *os.File, names []string, ids []fsat.ID) ([]*os.File, error) {
	var fs []*os.File
	for i, name := range names {
		f, err := fsat.Open(dir, name, unix.O_RDONLY)
		if err == nil {
			if id, ierr := fsat.IDOf(f); ierr != nil || id != ids[i] {
				f.Close()
				err = fmt.Errorf("%s: %w: not the file that was kept", f.Name(), fsat.ErrUnsafe)
			}
		}
		if err != nil {
			closeAll(fs)
			return nil, err
		}
		fs = append(fs, f)
	}
	return fs, nil
}

// removeFiles removes the kept files beneath dir that are still the ones
// kept.
func removeFiles(dir *os.File, names []string, ids []fsat.ID) {
	for i, name := range names {
		if f, err := fsat.Open(dir, name, unix.O_RDONLY); err == nil {
			id, ierr := fsat.IDOf(f)
			f.Close()
			if ierr == nil && id == ids[i] {
				unix.Unlinkat(int(dir.Fd()), name, 0)
			}
		}
	}
}

// FastRecover is `gpu resume --pid` for processes that run with the
// library, after the driver's restore and unlock: a process left parked by
// a gpucr-stream that died after the driver's lock (or by a failed refill)
// gets its memory back from the kept copy and runs on. Processes without
// the library, or not parked, are left alone. It returns those it resumed.
//
// A kept copy that left out what an earlier checkpoint holds (--dedup)
// is refilled whole from both: open opens that checkpoint again (its
// name from the record) for process pid.
func FastRecover(ctx context.Context, dir, records string, pids []int, open OpenEarlier) ([]int, error) {
	if records == "" {
		records = DefaultRecords()
	}
	var done []int
	var errs []error
	for _, pid := range pids {
		ok, err := recoverOne(ctx, dir, records, pid, open)
		if ok {
			done = append(done, pid)
		}
		errs = append(errs, err)
	}
	errs = append(errs, Reimport(ctx, dir, pids))
	return done, errors.Join(errs...)
}

// OpenEarlier opens the earlier checkpoint where (LOC/NAME, as an
// Earlier's Name) for process pid.
// The func it returns closes what it opened, once the refill is done.
type OpenEarlier func(ctx context.Context, where string, pid int) (*Earlier, func(), error)

func recoverOne(ctx context.Context, dir, records string, pid int, open OpenEarlier) (bool, error) {
	if !preloadctl.Loaded(pid) {
		return false, nil
	}
	p, err := preloadctl.Dial(ctx, dir, pid)
	if errors.Is(err, preloadctl.ErrNotLoaded) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer p.Close()
	r, err := p.Report(ctx)
	if err != nil {
		return false, err
	}
	if !r.Parked {
		// It runs: a copy still recorded for it is of a checkpoint that
		// ended (the library refilled on its own, and may not remove
		// root's files).
		if rec, err := loadRecord(records, pid); err == nil {
			rec.drop(records)
		}
		return false, nil
	}
	if !r.Released && !r.Unfilled {
		// Parked with its memory in place: it only needs to run on.
		return true, p.Recover(ctx, nil)
	}
	// The kept copy is found through gpucr-stream's own record, never
	// through what the process reports (r.Kept): its user may have it name
	// any file of root's.
	rec, err := loadRecord(records, pid)
	if err != nil {
		return false, fmt.Errorf("process %d is parked with its device memory not back: %w: bring it from its checkpoint with `gpu resume --pid %d --from SRC`", pid, err, pid)
	}
	kd, err := rec.openDir()
	if err != nil {
		return false, fmt.Errorf("process %d: %w (it stays parked; if its memory is in a checkpoint: `gpu resume --pid %d --from SRC`)", pid, err, pid)
	}
	defer kd.Close()
	if err := refillKept(ctx, p, kd, rec, open); err != nil {
		return false, fmt.Errorf("%w (it stays parked; if its memory is in a checkpoint: `gpu resume --pid %d --from SRC`)", err, pid)
	}
	removeFiles(kd, rec.Files, rec.IDs)
	if rec.Skip != "" {
		removeFiles(kd, []string{rec.Skip}, []fsat.ID{rec.SkipID})
	}
	removeRecord(records, pid)
	return true, nil
}

// refillKept sends p the kept copy rec names (in kd): its files, or, where
// they left out what an earlier checkpoint holds, whole files composed
// from them and that checkpoint.
func refillKept(ctx context.Context, p *preloadctl.Conn, kd *os.File, rec keptRecord, open OpenEarlier) error {
	if rec.Earlier == "" {
		fs, err := openFiles(kd, rec.Files, rec.IDs)
		if err != nil {
			return err
		}
		defer closeAll(fs)
		return p.Recover(ctx, fs)
	}
	if open == nil {
		return fmt.Errorf("process %d: its kept copy leaves out what %s holds, and nothing here opens it", rec.PID, rec.Earlier)
	}
	e, closeEarlier, err := open(ctx, rec.Earlier, rec.PID)
	if err != nil {
		return fmt.Errorf("process %d: its kept copy leaves out what %s holds: %w", rec.PID, rec.Earlier, err)
	}
	defer closeEarlier()
	sf, err := openFiles(kd, []string{rec.Skip}, []fsat.ID{rec.SkipID})
	if err != nil {
		return err
	}
	b, err := io.ReadAll(io.LimitReader(sf[0], 64<<20))
	closeAll(sf)
	if err != nil {
		return err
	}
	skip, err := parseSkip(b)
	if err != nil {
		return fmt.Errorf("%s: %w", rec.Skip, err)
	}
	fs, wait, err := composedPipes(ctx, &composer{key: e.Hashes.Key, skip: skip, earlier: e}, kd, rec.Files, rec.IDs)
	if err != nil {
		return err
	}
	err = p.Recover(ctx, fs)
	closeAll(fs)
	if werr := wait(); err != nil && werr != nil {
		err = fmt.Errorf("%w (%w)", err, werr)
	}
	return err
}
