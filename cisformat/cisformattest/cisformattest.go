// Package cisformattest reads the fixtures of criu-image-streamer 1.0.0
// (cisformat/testdata) for the tests that compare gpucr-stream with the
// real tool: cisformat's reader and the drop-in commands.
package cisformattest

import (
	"archive/tar"
	"io"
	"os"
	"path/filepath"
	"testing"
)

// Extracted is what the real tool's extract wrote, kept as the tar at path
// (a *.extracted.tar): its regular files by base name. A tar of none
// fails t (a comparison with it would pass whatever was extracted).
func Extracted(t testing.TB, path string) map[string][]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string][]byte{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			if len(out) == 0 {
				t.Fatalf("%s holds no file", path)
			}
			return out
		}
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatalf("%s: %s: %v", path, h.Name, err)
		}
		out[filepath.Base(h.Name)] = b
	}
}
