package criusock

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
)

// WriteExtract writes every file of src into dir (for sources that are not
// extracting on their own), each through a temporary name.
func WriteExtract(ctx context.Context, src source.Source, dir string) (int, int64, error) {
	files, err := src.Files(ctx)
	if err != nil {
		return 0, 0, err
	}
	return writeFiles(ctx, src, dir, files)
}

// writeFiles writes files of src into dir, each whole or not at all.
func writeFiles(ctx context.Context, src source.Source, dir string, files []manifest.File) (int, int64, error) {
	var total int64
	var done []string
	for _, f := range files {
		n, err := writeFileAtomic(ctx, src, dir, f)
		if err != nil {
			// A failed extract leaves no part of the image behind.
			for _, p := range done {
				os.Remove(p)
			}
			return 0, total, err
		}
		done = append(done, filepath.Join(dir, f.Name))
		total += n
	}
	return len(files), total, nil
}

func writeFileAtomic(ctx context.Context, src source.Source, dir string, f manifest.File) (int64, error) {
	if !ValidImageName(f.Name) {
		return 0, fmt.Errorf("extract: unsafe file name %q", f.Name)
	}
	tmp, err := os.CreateTemp(dir, "."+f.Name+".partial-*")
	if err != nil {
		return 0, fmt.Errorf("extract %s: %w", f.Name, err)
	}
	n, err := source.CopyToFile(ctx, src, f.Name, tmp)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), filepath.Join(dir, f.Name))
	}
	if err != nil {
		os.Remove(tmp.Name())
		return n, fmt.Errorf("extract %s: %w", f.Name, err)
	}
	return n, nil
}
