package gpuckpt

import (
	"context"
	"errors"
	"fmt"

	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/vram"
)

// VRAMFile is what one of the fast path's VRAM files in a checkpoint holds
// of a process's device memory (inspect): from its headers, how much was
// allocated, written (not zero), left out as a cache the program marked,
// and held; Stored is what the archive stores for the file.
type VRAMFile struct {
	Name string `json:"name"`
	PID  int    `json:"pid"`
	vram.FileStats
	Stored int64 `json:"stored"`
}

// ErrNotArchive says a checkpoint is read as a stream: its VRAM files'
// headers are not read apart from their data.
var ErrNotArchive = errors.New("not an archive (a stream's VRAM files are read whole)")

// InspectVRAM reads the headers of the VRAM files of the archive src,
// skipping their data: a chunk read per record at most.
func InspectVRAM(ctx context.Context, src source.Source) ([]VRAMFile, error) {
	a := location.ArchiveOf(src)
	if a == nil {
		return nil, ErrNotArchive
	}
	var out []VRAMFile
	for _, p := range a.Manifest().CUDA {
		if p.Path != manifest.CUDAPathPreload {
			continue
		}
		for _, name := range p.Files {
			r, size, err := a.ReaderAt(ctx, name)
			if err != nil {
				return out, err
			}
			st, err := vram.ReadFileStats(r, size)
			if err != nil {
				return out, fmt.Errorf("%s: %w", name, err)
			}
			v := VRAMFile{Name: name, PID: p.PID, FileStats: st}
			if f, ok := a.Manifest().Lookup(name); ok {
				for _, c := range f.Chunks {
					v.Stored += int64(c.Stored)
				}
			}
			out = append(out, v)
		}
	}
	return out, nil
}
