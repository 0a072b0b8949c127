package criusock

import (
	"context"
	"errors"
	"io"
	"os"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
)

// failingSource serves its files' names as content, and fails on bad.
type failingSource struct {
	files []string
	bad   string
}

func (s failingSource) Stat(ctx context.Context, name string) (manifest.File, error) {
	return manifest.File{Name: name, Size: int64(len(name))}, nil
}

func (s failingSource) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	if name == s.bad {
		return 0, errdefs.ErrCorrupt
	}
	n, err := io.WriteString(w, name)
	return int64(n), err
}

func (s failingSource) Files(ctx context.Context) ([]manifest.File, error) {
	var out []manifest.File
	for _, n := range s.files {
		out = append(out, manifest.File{Name: n, Size: int64(len(n))})
	}
	return out, nil
}

func (s failingSource) Close() error { return nil }

// A failed extract leaves none of the files it finished.
func TestWriteExtractFailureLeavesNothing(t *testing.T) {
	dir := t.TempDir()
	src := failingSource{files: []string{"a.img", "b.img", "c.img"}, bad: "c.img"}
	if _, _, err := WriteExtract(context.Background(), src, dir); !errors.Is(err, errdefs.ErrCorrupt) {
		t.Fatalf("WriteExtract: %v, want ErrCorrupt", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("failed extract left %d entries, first %s", len(ents), ents[0].Name())
	}
}
