package dir

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/storetest"
	"github.com/gpucr/gpucr-stream/testwait"
)

// A symlink planted as an object is never followed (a segment linked to
// /etc/shadow printed bytes of it), and a FIFO never blocks a reader (it
// hung verify, extract, inspect and ls forever, deaf to SIGTERM): only
// regular files are objects.
func TestDirRefusesSymlinksAndFIFOs(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(10*time.Second))
	defer cancel()
	root := t.TempDir()
	secret := filepath.Join(t.TempDir(), "shadow")
	if err := os.WriteFile(secret, []byte("root:SECRET:19000::::::"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(root, "segments"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(secret, filepath.Join(root, "segments", "00000000.gcs")); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(filepath.Join(root, "manifest.json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "segments", "00000001.gcs"), []byte("real"), 0o600); err != nil {
		t.Fatal(err)
	}
	st := New(root)
	for _, name := range []string{"segments/00000000.gcs", "manifest.json"} {
		done := make(chan struct{})
		go func() {
			defer close(done)
			if _, err := st.Stat(ctx, name); !errors.Is(err, ErrNotRegular) {
				t.Errorf("Stat %s: %v, want ErrNotRegular", name, err)
			}
			r, err := st.Open(ctx, name, 0, -1)
			if err == nil {
				b, _ := io.ReadAll(r)
				r.Close()
				t.Errorf("Open %s read %q", name, b)
			} else if !errors.Is(err, ErrNotRegular) || !errors.Is(err, errdefs.ErrCorrupt) {
				t.Errorf("Open %s: %v, want ErrNotRegular", name, err)
			} else if strings.Contains(err.Error(), "SECRET") {
				t.Errorf("Open %s: error shows the target: %v", name, err)
			}
		}()
		select {
		case <-done:
		case <-ctx.Done():
			t.Fatalf("%s: blocked", name)
		}
	}
	objs, err := st.List(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(objs) != 1 || objs[0].Name != "segments/00000001.gcs" {
		t.Fatalf("List: %+v, want the one regular file", objs)
	}
	// A regular file reads as before, with blocking reads.
	r, err := st.Open(ctx, "segments/00000001.gcs", 1, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if b, err := io.ReadAll(r); err != nil || string(b) != "eal" {
		t.Fatalf("regular file: %q %v", b, err)
	}
}

// A symlink above the object (a planted segments/ directory) is refused as
// well as one in its last component.
func TestDirRefusesSymlinkedDirectory(t *testing.T) {
	ctx := context.Background()
	root, outside := t.TempDir(), t.TempDir()
	if err := os.WriteFile(filepath.Join(outside, "00000000.gcs"), []byte("SECRET"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(root, "segments")); err != nil {
		t.Fatal(err)
	}
	st := New(root)
	if _, err := st.Stat(ctx, "segments/00000000.gcs"); !errors.Is(err, ErrNotRegular) {
		t.Errorf("Stat through a symlinked directory: %v, want ErrNotRegular", err)
	}
	if r, err := st.Open(ctx, "segments/00000000.gcs", 0, -1); err == nil {
		b, _ := io.ReadAll(r)
		r.Close()
		t.Errorf("Open through a symlinked directory read %q", b)
	} else if !errors.Is(err, ErrNotRegular) {
		t.Errorf("Open through a symlinked directory: %v, want ErrNotRegular", err)
	}
}

// Writes refuse a symlink below the root as reads do: `cp` into a
// destination whose segments/ was a planted link wrote the segments
// through it, into the directory it named, and left them there.
func TestDirWritesRefuseSymlinks(t *testing.T) {
	ctx := context.Background()
	root, outside := t.TempDir(), t.TempDir()
	if err := os.Symlink(outside, filepath.Join(root, "segments")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(outside, "victim"), []byte("kept"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(root, "ck"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(root, "ck", "segments")); err != nil {
		t.Fatal(err)
	}
	st := New(root)
	for _, name := range []string{"segments/00000000.gcs", "ck/segments/00000000.gcs", "segments/deeper/x"} {
		w, err := st.Create(ctx, name)
		if err == nil {
			w.Write([]byte("data"))
			err = w.Commit(ctx)
		}
		if !errors.Is(err, ErrNotRegular) || !strings.Contains(err.Error(), "segments") {
			t.Errorf("Create %s through a symlinked directory: %v, want ErrNotRegular naming it", name, err)
		}
		if err := st.Delete(ctx, strings.Replace(name, "00000000.gcs", "victim", 1)); !errors.Is(err, ErrNotRegular) {
			t.Errorf("Delete through a symlinked directory: %v, want ErrNotRegular", err)
		}
	}
	entries, err := os.ReadDir(outside)
	if err != nil || len(entries) != 1 || entries[0].Name() != "victim" {
		t.Fatalf("the link's target holds %v (%v), want only its own file", entries, err)
	}
	// The links themselves are left as they were, and an ordinary object
	// beside them is written as before.
	for _, l := range []string{"segments", "ck/segments"} {
		if fi, err := os.Lstat(filepath.Join(root, l)); err != nil || fi.Mode()&os.ModeSymlink == 0 {
			t.Errorf("%s: %v %v", l, fi, err)
		}
	}
	w, err := st.Create(ctx, "ck/manifest.json")
	if err != nil {
		t.Fatal(err)
	}
	w.Write([]byte("{}"))
	if err := w.CommitNew(ctx); err != nil {
		t.Fatal(err)
	}
}

// Where the filesystem has no RENAME_NOREPLACE (EINVAL), CommitNew falls
// back to link and unlink, as atomic: the whole suite passes that way.
func TestDirConformanceLinkFallback(t *testing.T) {
	defer func(f func(int, string, int, string, uint) error) { renameat2 = f }(renameat2)
	var calls atomic.Int64
	renameat2 = func(int, string, int, string, uint) error {
		calls.Add(1)
		return unix.EINVAL
	}
	storetest.Run(t, func(t *testing.T) store.Store { return New(t.TempDir()) })
	if calls.Load() == 0 {
		t.Fatal("CommitNew never tried renameat2")
	}
}
