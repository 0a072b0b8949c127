package vram

// The copy out of a --dedup checkpoint leaves out the blocks an earlier
// checkpoint of the process in the same location holds unchanged
// (docs/PRODUCERS.md, "Blocks an earlier checkpoint holds"): the kept
// copy then holds only what changed; the store names that checkpoint's
// chunks for the rest (storecut.go), and any undo reads it back
// (compose.go). Two steps of gpuckpt's table: FindEarlier, while the
// processes still run (the library's hints of where it went before, the
// checkpoint opened: its manifest, its record of the blocks, its chunks
// there), and Unchanged, parked, after the zero scan (the device's hashes
// compared with the checkpoint's record: the blocks to leave out, handed
// to the library). A process for which none is found, or nothing is
// unchanged, is copied whole, with a note saying why; an earlier
// checkpoint that is found and whose record cannot be read fails the
// checkpoint before any memory is released.

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/gpucr/gpucr-stream/fsat"
	"golang.org/x/sys/unix"
)

// Dedup is a --dedup checkpoint's side of the copy out.
type Dedup struct {
	// Loc names the location (a 64-bit hash of it: the library keeps the
	// checkpoints it went into by location); Name is this checkpoint's.
	Loc  uint64
	Name string
	// Find opens the checkpoint name of the location as an earlier
	// checkpoint of process pid: nil and why not where it is none
	// (removed, of another process, made without block hashes), an error
	// where it is one and cannot be read.
	Find func(ctx context.Context, pid int, name string) (*Earlier, string, error)
	// Note takes a line saying why a process's copy is whole.
	Note func(string)
	// Cuts, where set, stores the VRAM files by their cuts, naming the
	// chunks of the earlier checkpoint that the location holds
	// (storecut.go); else they go through the PutFunc whole.
	Cuts *CutPut
}

// hashesName is the BlockHashes file of process pid in a checkpoint.
func hashesName(pid int) string { return fmt.Sprintf("vram-%d.hashes", pid) }

// skipName is the skip file of process pid in the kept copy's directory.
func skipName(pid int) string { return fmt.Sprintf("vram-%d.skip", pid) }

func (s *FastSuspension) note(fp *fastProc, why string) {
	if s.opts.Dedup.Note != nil {
		s.opts.Dedup.Note(fmt.Sprintf("GPU fast path, process %d: the kept copy holds all its written device memory: %s", fp.PID, why))
	}
}

// FindEarlier finds, for every process, the latest checkpoint of the
// location that the library says it went into and that is one of its
// own, while the processes run. Find checks what it finds as it opens it
// (its manifest, its record of the blocks, that its chunks are there);
// its bytes are read only where they are used (an undo's refill, a group
// of blocks whose chunks it is not cut in), each block checked against
// the record there.
func (s *FastSuspension) FindEarlier(ctx context.Context) error {
	d := s.opts.Dedup
	if d == nil {
		return nil
	}
	for _, fp := range s.procs {
		names, err := fp.p.Bases(ctx, d.Loc)
		if err != nil {
			s.note(fp, fmt.Sprintf("its library cannot say where it went before (%v)", err))
			continue
		}
		var why []string
		for _, name := range names {
			e, reason, err := d.Find(ctx, fp.PID, name)
			if err != nil {
				return fmt.Errorf("process %d: %w; nothing was released (`gpucr-stream check --read-data` on the location finds what is damaged)", fp.PID, err)
			}
			if e != nil {
				fp.earlier = e
				break
			}
			why = append(why, reason)
		}
		switch {
		case fp.earlier != nil: // no note: it is built on
		case len(names) == 0:
			s.note(fp, "it went into no checkpoint of this location before")
		default:
			s.note(fp, "no earlier checkpoint of this location is one to build on: "+strings.Join(why, "; "))
		}
	}
	return nil
}

// Unchanged records in every library that the processes go into this
// checkpoint (Dedup.Name), and, for those an earlier checkpoint was found
// for, compares the device's block hashes with its record and has the
// library leave the blocks that did not change out of the copy out: the
// kept copy and the room it needs shrink by them. Nothing to revert
// (RemoveKeep removes the skip files).
func (s *FastSuspension) Unchanged(ctx context.Context) error {
	d := s.opts.Dedup
	if d == nil {
		return nil
	}
	for _, fp := range s.procs {
		fp.Hashes = hashesName(fp.PID)
		if err := fp.p.Based(ctx, d.Loc, d.Name); err != nil {
			s.note(fp, fmt.Sprintf("its library cannot keep where it went (%v); the next checkpoint copies it whole", err))
		}
		if fp.earlier == nil {
			key, err := newKey()
			if err != nil {
				return err
			}
			fp.key = key
			continue
		}
		fp.key = fp.earlier.Hashes.Key
		if err := s.leaveOut(ctx, fp); err != nil {
			return fmt.Errorf("process %d: leave out what %s holds: %w", fp.PID, fp.earlier.Name, err)
		}
	}
	return nil
}

// newKey is the hash key of a process's first BlockHashes in a location;
// later ones keep it.
func newKey() (uint64, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint64(b[:]), nil
}

// maxDeviceHashes bounds what `hashes` may write for allocated bytes: 24
// bytes a page covers blocks of any size, with room for the headers.
func maxDeviceHashes(allocated int64) int64 { return 1<<20 + allocated/4096*24 }

// memFile is an unnamed file in memory (the kept copy's directory may not
// be made yet: its size depends on what is left out).
func memFile(name string) (*os.File, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd: %w", err)
	}
	return os.NewFile(uintptr(fd), name), nil
}

// leaveOut has fp's library hash its memory, finds the blocks that are
// unchanged since fp.earlier, and has the library leave them out.
func (s *FastSuspension) leaveOut(ctx context.Context, fp *fastProc) error {
	f, err := memFile("gpucr-device-hashes")
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := fp.p.Hashes(ctx, fp.key, f); err != nil {
		return err
	}
	st, err := f.Stat()
	if err != nil {
		return err
	}
	if st.Size() > maxDeviceHashes(fp.Allocated) {
		return fmt.Errorf("the library wrote %d bytes of hashes for %d bytes of memory: %w", st.Size(), fp.Allocated, ErrVRAMFile)
	}
	b := make([]byte, st.Size())
	if _, err := f.ReadAt(b, 0); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	dev, err := parseDeviceHashes(b)
	if err != nil {
		return err
	}
	skip := unchanged(dev, fp.earlier.Hashes)
	if skip == nil {
		s.note(fp, fmt.Sprintf("none of its blocks is as %s holds it", fp.earlier.Name))
		return nil
	}
	sf, err := memFile("gpucr-skip")
	if err != nil {
		return err
	}
	defer sf.Close()
	sb, _ := skip.MarshalBinary()
	if _, err := sf.Write(sb); err != nil {
		return err
	}
	if _, err := sf.Seek(0, io.SeekStart); err != nil {
		return err
	}
	n, err := fp.p.Skip(ctx, sf)
	if err != nil {
		return err
	}
	if n != skip.bytes {
		return fmt.Errorf("the library leaves out %d bytes, %d were asked: %w", n, skip.bytes, ErrVRAMFile)
	}
	fp.skip, fp.Reused, fp.Earlier = skip, n, fp.earlier.Name
	fp.need -= n
	return nil
}

// writeSkip writes fp's skip file into the kept copy's directory, beside
// its files, for a `gpu resume --pid` after gpucr-stream's death (its
// record names it).
func (s *FastSuspension) writeSkip(fp *fastProc) error {
	if fp.skip == nil {
		return nil
	}
	f, err := fsat.Create(s.keepDir, skipName(fp.PID), unix.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if fp.skipID, err = fsat.IDOf(f); err == nil {
		fp.skipFile = skipName(fp.PID)
		b, _ := fp.skip.MarshalBinary()
		_, err = f.Write(b)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("process %d: skip file: %w", fp.PID, err)
	}
	return nil
}

// composerOf is what makes fp's VRAM files whole from its kept copy.
func (fp *fastProc) composer() *composer {
	return &composer{key: fp.key, skip: fp.skip, earlier: fp.earlier}
}
