package dir_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/storetest"
)

func TestDirConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) store.Store { return dir.New(t.TempDir()) })
}

// TestVolatileDirConformance: a store whose commits do not sync behaves
// as a store all the same.
func TestVolatileDirConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) store.Store { return dir.NewVolatile(t.TempDir()) })
}

// TestNoEmptyDirsLeft: an aborted write and the last delete in a directory
// leave no empty directories below the root (a failed checkpoint's
// segments/); the root, and the parents of it the store made, go with the
// last object when the store made them (a failed checkpoint into a new
// directory), and stay when they were there.
func TestNoEmptyDirsLeft(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		exists string // made before the store writes ("" none)
		gone   string // the highest directory gone at the end ("" none)
	}{
		{"root made", "", "a"},
		{"root there", "a/b/root", ""},
		{"parent there", "a", "a/b"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := t.TempDir()
			root := filepath.Join(base, "a/b/root")
			if tc.exists != "" {
				if err := os.MkdirAll(filepath.Join(base, tc.exists), 0o755); err != nil {
					t.Fatal(err)
				}
			}
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
			checkRoot(t, base, tc.exists, tc.gone, "after the aborted write")
			for _, name := range []string{"ck/segments/000.seg", "ck/segments/001.seg", "ck/manifest.json", "lock"} {
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
				{"ck/manifest.json", "ck", "."},
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
				if _, err := os.Stat(filepath.Join(root, s.kept)); err != nil {
					t.Errorf("after deleting %s: %s gone too early", s.name, s.kept)
				}
			}
			if err := d.Delete(ctx, "lock"); err != nil {
				t.Fatal(err)
			}
			checkRoot(t, base, tc.exists, tc.gone, "after the last delete")
		})
	}
}

// checkRoot checks that base/gone is gone and base/exists is there.
func checkRoot(t *testing.T, base, exists, gone, when string) {
	t.Helper()
	if gone != "" {
		if _, err := os.Stat(filepath.Join(base, gone)); !os.IsNotExist(err) {
			t.Errorf("%s: %s, which the store made, is still there (%v)", when, gone, err)
		}
	}
	if exists != "" {
		if _, err := os.Stat(filepath.Join(base, exists)); err != nil {
			t.Errorf("%s: %s, which was there before, is gone: %v", when, exists, err)
		}
	}
}

// TestRemoveTempEmptyDirs: gc's sweep removes, once old enough, the
// temporary files of objects it recognises and the empty directories it
// recognises (a failed checkpoint's segments/) or emptied (then its own
// dir), deepest first; never a directory in use, the root, a user's empty
// directory or a file that only looks temporary. A dry run names the same.
func TestRemoveTempEmptyDirs(t *testing.T) {
	root := t.TempDir()
	old := time.Now().Add(-2 * time.Hour)
	mk := func(p string, age time.Time) {
		if err := os.MkdirAll(filepath.Join(root, p), 0o755); err != nil {
			t.Fatal(err)
		}
		os.Chtimes(filepath.Join(root, p), age, age)
	}
	file := func(p string, age time.Time) {
		if err := os.WriteFile(filepath.Join(root, p), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		os.Chtimes(filepath.Join(root, p), age, age)
	}
	mk("failed/segments", old)
	mk("failed", old)
	mk("fresh/segments", time.Now())
	mk("kept", old)
	file("kept/manifest.json", old)
	os.Chtimes(filepath.Join(root, "kept"), old, old)
	mk("killed", old)
	file("killed/.manifest.json.tmp-12345", old)
	os.Chtimes(filepath.Join(root, "killed"), old, old)
	// The user's own: an empty directory tree, a file named like a
	// temporary one.
	mk("photos/2019", old)
	mk("photos", old)
	file(".notes.txt.tmp-7", old)
	ours := func(name string) bool {
		return strings.HasSuffix(name, "segments/") || name == "manifest.json" || strings.HasSuffix(name, "/manifest.json")
	}
	want := []string{"killed/.manifest.json.tmp-12345", "killed/", "failed/segments/", "failed/"}
	d := dir.New(root)
	names, err := d.RemoveTemp(context.Background(), time.Now().Add(-time.Hour), true, ours)
	if err != nil || !slices.Equal(names, want) {
		t.Fatalf("dry run: %q, %v; want %q", names, err, want)
	}
	if _, err := os.Stat(filepath.Join(root, "failed/segments")); err != nil {
		t.Fatal("dry run removed something")
	}
	names, err = d.RemoveTemp(context.Background(), time.Now().Add(-time.Hour), false, ours)
	if err != nil || !slices.Equal(names, want) {
		t.Fatalf("removed %q, %v; want %q", names, err, want)
	}
	for p, want := range map[string]bool{"failed": false, "killed": false, "fresh/segments": true, "kept/manifest.json": true, "": true,
		"photos/2019": true, ".notes.txt.tmp-7": true} {
		if _, err := os.Stat(filepath.Join(root, p)); (err == nil) != want {
			t.Errorf("%s: exists %v, want %v", p, err == nil, want)
		}
	}
	// No root yet: nothing to remove.
	if names, err := dir.New(filepath.Join(root, "none")).RemoveTemp(context.Background(), time.Now(), false, ours); err != nil || len(names) != 0 {
		t.Errorf("no root: %q, %v", names, err)
	}
}

// TestRemoveTempBesideRemoval: a directory removed while gc's sweep walks
// the store (an rm of another checkpoint meanwhile) is one less to look
// at, not a failure: gc failed so, beside rm (found by the torture test,
// e2e/torture_test.go).
func TestRemoveTempBesideRemoval(t *testing.T) {
	root := t.TempDir()
	old := time.Now().Add(-2 * time.Hour)
	for _, p := range []string{"a/.manifest.json.tmp-1", "b/segments/x-00000000.gcs"} {
		if err := os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, p), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		os.Chtimes(filepath.Join(root, p), old, old)
	}
	ours := func(string) bool {
		if err := os.RemoveAll(filepath.Join(root, "b")); err != nil { // the walk has read the root, not b
			t.Fatal(err)
		}
		return true
	}
	names, err := dir.New(root).RemoveTemp(context.Background(), time.Now(), false, ours)
	if err != nil || !slices.Equal(names, []string{"a/.manifest.json.tmp-1", "a/"}) {
		t.Fatalf("sweep beside a removal: %q, %v", names, err)
	}
}

// A writer that loses CommitNew removes its temporary file.
func TestDirLostCommitLeavesNothing(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	d := dir.New(root)
	for i, want := range []error{nil, errdefs.ErrExists, errdefs.ErrExists} {
		w, err := d.Create(ctx, "ck/manifest.json")
		if err != nil {
			t.Fatal(err)
		}
		w.Write([]byte{byte('a' + i)})
		if err := w.CommitNew(ctx); !errors.Is(err, want) || (want == nil) != (err == nil) {
			t.Fatalf("writer %d: %v, want %v", i, err, want)
		}
	}
	entries, err := os.ReadDir(filepath.Join(root, "ck"))
	if err != nil || len(entries) != 1 || entries[0].Name() != "manifest.json" {
		t.Fatalf("ck/ holds %v (%v), want only manifest.json", entries, err)
	}
	if b, _ := os.ReadFile(filepath.Join(root, "ck", "manifest.json")); string(b) != "a" {
		t.Fatalf("manifest.json = %q, want the first writer's", b)
	}
}

// BenchmarkCommitAfterWrite: what a commit waits for after 256 MiB were
// written to an object on this machine's disk (GPUCR_BENCH_DIR, else
// /var/tmp): with write-behind the fsync finds most of it written. The
// disk's own speed is the bound of write+commit; commit-ms is the part
// left to the commit.
func BenchmarkCommitAfterWrite(b *testing.B) {
	root := os.Getenv("GPUCR_BENCH_DIR")
	if root == "" {
		root = "/var/tmp"
	}
	tmp, err := os.MkdirTemp(root, "gpucr-commit-bench-")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(tmp)
	st := dir.New(tmp)
	buf := make([]byte, 1<<20)
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	var commit time.Duration
	for i := 0; b.Loop(); i++ {
		w, err := st.Create(context.Background(), fmt.Sprintf("obj-%d", i))
		if err != nil {
			b.Fatal(err)
		}
		for range 256 {
			if _, err := w.Write(buf); err != nil {
				b.Fatal(err)
			}
		}
		start := time.Now()
		if err := w.Commit(context.Background()); err != nil {
			b.Fatal(err)
		}
		commit += time.Since(start)
	}
	b.ReportMetric(float64(commit.Milliseconds())/float64(b.N), "commit-ms")
}
