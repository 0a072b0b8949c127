package source

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// spillFiles hold a stream's chunks beyond the budget: up to max unlinked
// files, created as spilling reaches them (at). Guarded by
// StreamSource.mu, but for dir, set once.
type spillFiles struct {
	// dir holds them, and the frames the budget has no room for
	// (newFileBuf); empty means os.TempDir().
	dir   string
	files []spillFile
	next  int // round-robin counter: the next chunk's file is next % max
	// max is min(GOMAXPROCS, maxSpillFiles): more files than writes
	// that can run at once buy nothing.
	max int
}

// spillFile is one file a stream spills into: append-only, so a chunk
// spliced out of it is never written over.
type spillFile struct {
	f   *os.File
	end int64
}

// maxSpillFiles caps how many files a stream spills into (8 tmpfs files
// written at once took 18.7 GB/s, one 3.5); a variable for the benchmark
// that compares one file against several.
var maxSpillFiles = 8

// at reserves n bytes in a spill file and says where. Chunks go to the
// files in turn: one file's writes serialize on its inode lock (buffered
// writes to one tmpfs file top out near 3.5 GB/s whatever the number of
// writers, several files scale), so concurrent decoders must write
// different files. Round robin under the lock needs no notion of which
// goroutine writes, fills the files evenly, and two decoders share a file
// only when one write lags max others; the files are created as the turn
// first reaches them, so a stream that spills a little makes few.
func (sp *spillFiles) at(n int64) (*os.File, int64, error) {
	i := sp.next % sp.max
	if i == len(sp.files) {
		f, err := os.CreateTemp(sp.dir, "gpucr-spill-*")
		if err != nil {
			return nil, 0, fmt.Errorf("spill to disk: %w", err)
		}
		os.Remove(f.Name()) // unlinked: gone when closed, even after a crash
		sp.files = append(sp.files, spillFile{f: f})
	}
	sp.next++
	file := &sp.files[i]
	off := file.end
	file.end += n
	return file.f, off, nil
}

// close closes the files, which frees their blocks.
func (sp *spillFiles) close() {
	for _, file := range sp.files {
		file.f.Close()
	}
	sp.files = nil
}

// ErrNoSpace means a stream would fill the file system it spills or
// extracts to: its chunks may declare far more than it carries.
var ErrNoSpace = errors.New("not enough free space")

// spaceLeft is the free space on f's file system for an unprivileged
// writer, and its size (a variable for tests).
var spaceLeft = func(f *os.File) (avail, total int64, err error) {
	var st unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &st); err != nil {
		return 0, 0, err
	}
	return int64(st.Bavail) * st.Bsize, int64(st.Blocks) * st.Bsize, nil
}

// RoomFor refuses to write n more bytes to f when that would leave less
// than a reserve (5% of the file system, at most 1 GiB) free: a stream of
// well-compressed chunks must not fill the disk it spills to.
func RoomFor(f *os.File, n int64) error {
	avail, total, err := spaceLeft(f)
	if err != nil {
		return nil // unknown: a full disk still fails the write
	}
	reserve := min(total/20, 1<<30)
	if n > avail-reserve {
		return fmt.Errorf("%s: %d more bytes would leave less than %d of its file system's %d free bytes: %w", f.Name(), n, reserve, avail, ErrNoSpace)
	}
	return nil
}
