package catalog

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/mem"
)

// checkFiles reads every file of the checkpoint in st and compares it.
func checkFiles(t *testing.T, st store.Store, key *crypt.Key, want map[string][]byte) {
	t.Helper()
	ctx := context.Background()
	a, err := source.OpenArchive(ctx, st, pipeline.Options{Key: key, VerifyHashes: true})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if _, err := source.VerifyArchive(ctx, a); err != nil {
		t.Fatalf("verify %s: %v", st, err)
	}
	for n, b := range want {
		var got bytes.Buffer
		if _, err := a.Copy(ctx, n, &got); err != nil || !bytes.Equal(got.Bytes(), b) {
			t.Errorf("%s in %s: %v", n, st, err)
		}
	}
}

func names(t *testing.T, st store.Store) []string {
	t.Helper()
	objs, err := st.List(context.Background(), "")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, o := range objs {
		out = append(out, o.Name)
	}
	return out
}

// oldNames renames the segments of the checkpoint in st to the names
// every capture used before 2026-11-28 (segments/00000000.gcs, ...) and
// rewrites its manifest to match, as an archive of then looks.
func oldNames(t *testing.T, st *mem.Store, key *crypt.Key) {
	t.Helper()
	ctx := context.Background()
	m, err := source.ReadManifest(ctx, st)
	if err != nil {
		t.Fatal(err)
	}
	for i := range m.Segments {
		old := fmt.Sprintf("%s%08d.gcs", manifest.SegmentPrefix, i)
		st.Put(old, st.Object(m.Segments[i].Name))
		st.Delete(ctx, m.Segments[i].Name)
		m.Segments[i].Name = old
	}
	seal, err := pipeline.OpenSession(key, m.Encryption)
	if err != nil {
		t.Fatal(err)
	}
	doc, err := pipeline.MarshalManifest(m, seal)
	if err != nil {
		t.Fatal(err)
	}
	st.Put(manifest.ManifestName, doc)
}

// Archives of formats 1 to 3 written with the old segment names (the same
// in every capture) read, list, copy, verify and remove as before, and gc
// leaves them alone.
func TestOldSegmentNames(t *testing.T) {
	ctx := context.Background()
	key, err := crypt.NewKey(bytes.Repeat([]byte{9}, crypt.KeySize))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		version int
		opts    pipeline.Options
	}{
		{1, pipeline.Options{ChunkHashes: true}},
		{2, pipeline.Options{Key: key}},
		{3, pipeline.Options{}},
	} {
		t.Run(fmt.Sprintf("v%d", tc.version), func(t *testing.T) {
			st := mem.New("old")
			want := archiveWith(t, st, uint64(tc.version), tc.opts)
			oldNames(t, st, tc.opts.Key)
			m, err := source.ReadManifest(ctx, st)
			if err != nil || m.Format != tc.version || m.Segments[0].Name != "segments/00000000.gcs" {
				t.Fatalf("manifest: format %d, segments %+v, %v", m.Format, m.Segments, err)
			}
			checkFiles(t, st, tc.opts.Key, want)
			entries, err := List(ctx, st, "mem://old")
			if err != nil || len(entries) != 1 || entries[0].Error != "" || entries[0].Segments != len(m.Segments) {
				t.Fatalf("List: %+v, %v", entries, err)
			}
			all := names(t, st)
			if res, err := GC(ctx, st, "mem://old", 0, false, 0); err != nil || res.Objects != 0 {
				t.Fatalf("gc of a complete old archive: %+v, %v", res, err)
			}
			dst := mem.New("copy")
			if _, err := Copy(ctx, st, dst, pipeline.Options{Key: tc.opts.Key}, nil); err != nil {
				t.Fatal(err)
			}
			checkFiles(t, dst, tc.opts.Key, want)
			res, err := Remove(ctx, st, "mem://old", false)
			if err != nil || res.Objects != len(all) {
				t.Fatalf("rm: %+v, %v; want %d objects", res, err, len(all))
			}
			if left := names(t, st); len(left) != 0 {
				t.Fatalf("rm left %v", left)
			}
		})
	}
}

// plantLeftovers leaves segments of a capture that was killed before its
// commit, with a capture id of its own.
func plantLeftovers(st *mem.Store, id uint64, n int) []string {
	var out []string
	for i := range n {
		name := manifest.SegmentName(id, i)
		st.Put(name, bytes.Repeat([]byte{byte(i)}, 1000))
		out = append(out, name)
	}
	return out
}

// Beside a committed checkpoint, segments of other captures (one that
// lost the commit race and was killed before it removed them): ls counts
// only the checkpoint's bytes, rm removes exactly the segments its
// manifest names, and gc removes the others, once old, but never the
// checkpoint's.
func TestLeftoversBesideACheckpoint(t *testing.T) {
	ctx := context.Background()
	st := mem.New("shared")
	want := archiveIn(t, st, 5)
	m, err := source.ReadManifest(ctx, st)
	if err != nil {
		t.Fatal(err)
	}
	mine := []string{manifest.ManifestName}
	objBytes := int64(len(st.Object(manifest.ManifestName)))
	for _, s := range m.Segments {
		mine = append(mine, s.Name)
		objBytes += s.Size
	}
	stored := m.Stats.StoredBytes
	sort.Strings(mine)
	leftovers := plantLeftovers(st, 0xbad, 3)
	plantLeftovers(st, 0xbad2, 1)

	entries, err := List(ctx, st, "mem://shared")
	if err != nil || len(entries) != 1 || entries[0].StoredBytes != stored || entries[0].Segments != len(m.Segments) {
		t.Fatalf("List: %+v, %v; want one checkpoint of %d stored bytes", entries, err, stored)
	}
	// Recent leftovers stay (their capture may still be running).
	if res, err := GC(ctx, st, "mem://shared", time.Hour, false, 0); err != nil || res.Objects != 0 {
		t.Fatalf("gc of recent leftovers: %+v, %v", res, err)
	}
	res, err := GC(ctx, st, "mem://shared", 0, false, 0)
	if err != nil || res.Objects != 4 || len(res.Unfinished) != 1 || res.Bytes != 4000 {
		t.Fatalf("gc: %+v, %v; want the 4 leftovers", res, err)
	}
	if got := names(t, st); !slices.Equal(got, mine) {
		t.Fatalf("after gc the store holds %v, want %v", got, mine)
	}
	checkFiles(t, st, nil, want)

	// rm takes the checkpoint's own objects and nothing else.
	plantLeftovers(st, 0xbad, 3)
	rm, err := Remove(ctx, st, "mem://shared", false)
	if err != nil || rm.Objects != len(mine) || rm.Bytes != objBytes {
		t.Fatalf("rm: %+v, %v; want %d objects, %d bytes", rm, err, len(mine), objBytes)
	}
	if got := names(t, st); !slices.Equal(got, leftovers) {
		t.Fatalf("after rm the store holds %v, want the other capture's %v", got, leftovers)
	}
	if res, err := GC(ctx, st, "mem://shared", 0, false, 0); err != nil || res.Objects != 3 || len(names(t, st)) != 0 {
		t.Fatalf("gc after rm: %+v, %v, left %v", res, err, names(t, st))
	}
}

// A manifest that cannot be read is removed alone by rm; its segments,
// which cannot be told from another capture's, are left for gc, and gc
// removes nothing beside a manifest it cannot read.
func TestRemoveUnreadableManifest(t *testing.T) {
	ctx := context.Background()
	st := mem.New("bad")
	archiveIn(t, st, 6)
	st.Put(manifest.ManifestName, []byte("{not json"))
	n := len(names(t, st))
	if res, err := GC(ctx, st, "mem://bad", 0, false, 0); err != nil || res.Objects != 0 {
		t.Fatalf("gc beside an unreadable manifest: %+v, %v", res, err)
	}
	res, err := Remove(ctx, st, "mem://bad", false)
	if err != nil || res.Objects != 1 || res.Unread == "" {
		t.Fatalf("rm: %+v, %v", res, err)
	}
	if left := names(t, st); len(left) != n-1 {
		t.Fatalf("rm left %v", left)
	}
	if res, err := GC(ctx, st, "mem://bad", 0, false, 0); err != nil || res.Objects != n-1 || len(names(t, st)) != 0 {
		t.Fatalf("gc after rm: %+v, %v", res, err)
	}
}

// commitFirst is a store in which, just before the manifest is created,
// another writer commits a checkpoint: the race two copies to one
// destination run.
type commitFirst struct {
	*mem.Store
	first func()
}

func (c commitFirst) Create(ctx context.Context, name string) (store.ObjectWriter, error) {
	if name == manifest.ManifestName && c.first != nil {
		c.first()
	}
	return c.Store.Create(ctx, name)
}

// A copy that loses the race to commit fails, removes its segments, and
// leaves the winner whole; a copy that loses to the same checkpoint
// succeeds.
func TestCopyLosesRace(t *testing.T) {
	ctx := context.Background()
	a, b := mem.New("a"), mem.New("b")
	wantA := archiveIn(t, a, 7)
	archiveIn(t, b, 8)
	dst := commitFirst{Store: mem.New("dst")}
	dst.first = func() {
		if _, err := Copy(ctx, a, dst.Store, pipeline.Options{}, nil); err != nil {
			t.Errorf("winning copy: %v", err)
		}
	}
	_, err := Copy(ctx, b, dst, pipeline.Options{}, nil)
	if !errors.Is(err, errdefs.ErrExists) || !errors.Is(err, ErrOtherCheckpoint) {
		t.Fatalf("losing copy: %v, want ErrExists and ErrOtherCheckpoint", err)
	}
	if got, want := names(t, dst.Store), names(t, a); !slices.Equal(got, want) {
		t.Fatalf("destination holds %v, want the winner's %v", got, want)
	}
	checkFiles(t, dst.Store, nil, wantA)

	same := commitFirst{Store: mem.New("same")}
	same.first = func() {
		if _, err := Copy(ctx, a, same.Store, pipeline.Options{}, nil); err != nil {
			t.Errorf("winning copy: %v", err)
		}
	}
	if res, err := Copy(ctx, a, same, pipeline.Options{}, nil); err != nil || !res.Already {
		t.Fatalf("copy that lost to the same checkpoint: %+v, %v", res, err)
	}
	checkFiles(t, same.Store, nil, wantA)
}

// cp into a directory whose segments/ is a planted symlink is refused,
// and writes nothing where the link points.
func TestCopyIntoSymlinkedSegments(t *testing.T) {
	ctx := context.Background()
	src := mem.New("src")
	archiveIn(t, src, 9)
	root, outside := t.TempDir(), t.TempDir()
	if err := os.Symlink(outside, filepath.Join(root, "segments")); err != nil {
		t.Fatal(err)
	}
	if _, err := Copy(ctx, src, dir.New(root), pipeline.Options{}, nil); !errors.Is(err, dir.ErrNotRegular) {
		t.Fatalf("copy through a symlinked segments/: %v, want dir.ErrNotRegular", err)
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 0 {
		t.Fatalf("the link's target got %d files", len(entries))
	}
	if _, err := os.Stat(filepath.Join(root, manifest.ManifestName)); !os.IsNotExist(err) {
		t.Fatalf("manifest written: %v", err)
	}
}

// A segment of the same name but other bytes in the destination (another
// capture's, of an archive with the old names that every capture shared)
// is never replaced: the copy fails and leaves it.
func TestCopyNeverReplacesASegment(t *testing.T) {
	ctx := context.Background()
	src := mem.New("src")
	archiveIn(t, src, 10)
	m, err := source.ReadManifest(ctx, src)
	if err != nil {
		t.Fatal(err)
	}
	dst := mem.New("dst")
	theirs := []byte("another capture's segment")
	dst.Put(m.Segments[1].Name, theirs)
	if _, err := Copy(ctx, src, dst, pipeline.Options{}, nil); !errors.Is(err, errdefs.ErrExists) {
		t.Fatalf("copy over another segment: %v, want ErrExists", err)
	}
	if got := dst.Object(m.Segments[1].Name); !bytes.Equal(got, theirs) {
		t.Fatalf("the other segment was replaced")
	}
	if _, err := dst.Stat(ctx, manifest.ManifestName); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("manifest written: %v", err)
	}
}
