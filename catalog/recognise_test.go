package catalog

import (
	"context"
	"errors"
	"testing"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store/mem"
)

func TestOurs(t *testing.T) {
	seg := manifest.SegmentName(0xabc, 1)
	for _, tc := range []struct {
		name string
		ours bool
	}{
		{"manifest.json", true},
		{"a/b/manifest.json", true},
		{seg, true},
		{"a/" + seg, true},
		{"segments/", true},
		{"a/b/segments/", true},
		{chunkstore.Dir, true},
		{chunkstore.PackPrefix + "x.pack", true},
		{"a/" + chunkstore.IndexPrefix, true},
		{"notes.txt", false},
		{"a/segments/notes.txt", false},
		{"photos/", false},
		{"photos/2019/", false},
		{"my-segments/", false},
		{"xgpucr-chunks/packs/x.pack", false},
	} {
		if got := ours(tc.name); got != tc.ours {
			t.Errorf("ours(%q) = %v, want %v", tc.name, got, tc.ours)
		}
	}
}

// TestGCRefusesForeign: gc of a location holding nothing of gpucr-stream's
// is refused (errdefs.ErrNotFound) and removes nothing; one segment of
// ours is enough to go on.
func TestGCRefusesForeign(t *testing.T) {
	ctx := context.Background()
	st := mem.New("home")
	put := func(name string) {
		w, err := st.Create(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		w.Write([]byte("x"))
		if err := w.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	put("notes.txt")
	put("a/segments/readme")
	for _, dry := range []bool{true, false} {
		_, err := GC(ctx, st, "mem://home", 0, dry, 0)
		if !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("gc (dry run %v) of a foreign location: %v", dry, err)
		}
	}
	if objs, _ := st.List(ctx, ""); len(objs) != 2 {
		t.Fatalf("a refused gc removed something: %v", objs)
	}
	put("b/" + manifest.SegmentName(1, 0))
	res, err := GC(ctx, st, "mem://home", 0, true, 0)
	if err != nil || len(res.Names) != 1 || res.Names[0] != "b/"+manifest.SegmentName(1, 0) {
		t.Fatalf("gc --dry-run: %+v, %v", res, err)
	}
}
