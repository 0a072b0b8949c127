package source

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/gpucr/gpucr-stream/manifest"
)

// extraction is the state of a stream extract (ExtractDir), guarded by
// StreamSource.mu: each file is written as it arrives under a temporary
// name (create), and all are renamed into place once the whole stream is
// in and checked (publish).
type extraction struct {
	dir string
	// spare are temporary files emptied for the next file (keep), at most
	// maxSpare of them.
	spare    []spareFile
	maxSpare int
	// extracted are the files renamed into dir so far.
	extracted []string
}

// spareFile is an emptied temporary file of the extract directory.
type spareFile struct {
	fd   *os.File
	path string
}

// maxSpare caps the temporary files kept empty for reuse: as many files
// as may be arriving at once (a DATA frame of each queued for the
// workers, on them, or on its way from a shard's reader), so that a file
// is removed only when fewer arrive at once than did before.
func maxSpare(workers, shards int) int { return 2*workers + shards }

// create opens the temporary file that file id, name, is written into: a
// spare one, else a fresh name.
func (x *extraction) create(name string, id uint32) (*os.File, string, error) {
	if k := len(x.spare); k > 0 {
		sp := x.spare[k-1]
		x.spare = x.spare[:k-1]
		return sp.fd, sp.path, nil
	}
	// A fresh name, created exclusively: whatever was planted in the
	// directory (a symlink to a victim) is never opened.
	fd, err := os.CreateTemp(x.dir, fmt.Sprintf(".%s.partial-%d-*", name, id))
	if err != nil {
		return nil, "", fmt.Errorf("extract %s: %w", manifest.PrintableName(name), err)
	}
	return fd, fd.Name(), nil
}

// keep takes the temporary file of f, replaced by a later copy, emptied
// for the next file, while fewer than maxSpare are kept: created and
// removed for each of 100,000 copies of one file, temporary files took
// 36 s of a 42 s extract (on ext4 each create searches the inodes
// recently deleted).
func (x *extraction) keep(f *streamFile) {
	if len(x.spare) < x.maxSpare && f.fd.Truncate(0) == nil {
		x.spare = append(x.spare, spareFile{f.fd, f.tmpPath})
		f.fd, f.tmpPath = nil, ""
	}
}

// dropSpare removes the spare temporary files: the stream ended, and the
// directory holds the files it extracted alone.
func (x *extraction) dropSpare() {
	for _, sp := range x.spare {
		sp.fd.Close()
		os.Remove(sp.path)
	}
	x.spare = nil
}

// publish renames the extracted files into place once the whole stream is
// in and checked: a stream that replaces one file 100,000 times renames it
// once (renaming over an existing file flushes its data on ext4: 6 minutes
// for 100,000), and a stream that fails renames none.
func (x *extraction) publish(complete map[string]*streamFile) error {
	for _, f := range complete {
		if f.tmpPath == "" {
			continue
		}
		final := filepath.Join(x.dir, f.name)
		if err := os.Rename(f.tmpPath, final); err != nil {
			return fmt.Errorf("extract %s: %w", manifest.PrintableName(f.name), err)
		}
		x.extracted = append(x.extracted, final)
		f.tmpPath = ""
	}
	return nil
}

// undo removes the files published so far.
func (x *extraction) undo() {
	for _, p := range x.extracted {
		os.Remove(p)
	}
	x.extracted = nil
}
