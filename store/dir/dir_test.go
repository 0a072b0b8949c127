package dir_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/storetest"
)

func TestDirConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) store.Store { return dir.New(t.TempDir()) })
}

// TestNoEmptyDirsLeft: an aborted write and the last delete in a directory
// leave no empty directories below the root (a failed checkpoint's
// segments/); the root itself stays.
func TestNoEmptyDirsLeft(t *testing.T) {
	ctx := context.Background()
	root := filepath.Join(t.TempDir(), "root")
	d := dir.New(root)
	w, err := d.Create(ctx, "ck/segments/000.seg")
	if err != nil {
		t.Fatal(err)
	}
	w.Write([]byte("x"))
	if err := w.Abort(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "ck")); !os.IsNotExist(err) {
		t.Fatalf("aborted write left %s/ck: %v", root, err)
	}
	for _, name := range []string{"ck/segments/000.seg", "ck/segments/001.seg", "ck/manifest.json"} {
		w, err := d.Create(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		w.Write([]byte(name))
		if err := w.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	steps := []struct {
		name string
		gone string // a directory that must be gone after this delete ("" none)
		kept string
	}{
		{"ck/segments/000.seg", "", "ck/segments"},
		{"ck/segments/001.seg", "ck/segments", "ck"},
		{"ck/manifest.json", "ck", ""},
	}
	for _, s := range steps {
		if err := d.Delete(ctx, s.name); err != nil {
			t.Fatal(err)
		}
		if s.gone != "" {
			if _, err := os.Stat(filepath.Join(root, s.gone)); !os.IsNotExist(err) {
				t.Errorf("after deleting %s: %s still there (%v)", s.name, s.gone, err)
			}
		}
		if s.kept != "" {
			if _, err := os.Stat(filepath.Join(root, s.kept)); err != nil {
				t.Errorf("after deleting %s: %s gone too early", s.name, s.kept)
			}
		}
	}
	if _, err := os.Stat(root); err != nil {
		t.Errorf("root removed: %v", err)
	}
}
