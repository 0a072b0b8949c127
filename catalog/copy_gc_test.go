package catalog

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/mem"
)

// gatedStore is a checkpoint's store whose manifest write waits for
// gate.
type gatedStore struct {
	store.Store
	gate func()
}

func (g *gatedStore) Create(ctx context.Context, name string) (store.ObjectWriter, error) {
	if name == manifest.ManifestName {
		g.gate()
	}
	return g.Store.Create(ctx, name)
}

func (g *gatedStore) Parent() (store.Store, string, bool) { return store.Parent(g.Store) }

// gcWatch is a location whose locked is called each time a gc holds it
// with no capture in flight, right before it reads what is live: the only
// listing of the whole location made while a gc lock is there.
type gcWatch struct {
	store.Store
	locked func()
}

func (w *gcWatch) List(ctx context.Context, prefix string) ([]store.ObjectInfo, error) {
	if prefix == "" {
		locks, err := w.Store.List(ctx, chunkstore.LockPrefix)
		if err != nil {
			return nil, err
		}
		for _, l := range locks {
			if strings.HasPrefix(l.Name, chunkstore.LockPrefix+chunkstore.LockGC+"-") {
				w.locked()
				break
			}
		}
	}
	return w.Store.List(ctx, prefix)
}

func (w *gcWatch) Parent() (store.Store, string, bool) { return store.Parent(w.Store) }

// TestCopyBesideGC: a cp of a deduplicated checkpoint into its own
// location shares the packs there. A gc that took its lock before cp's
// took them for unreferenced, its source removed meanwhile, and cp
// committed a copy that could not be read (found by the torture test,
// e2e/torture_test.go). cp now refuses to share a pack while a gc holds
// the location.
func TestCopyBesideGC(t *testing.T) {
	ctx := context.Background()
	loc := mem.New("loc")
	files := map[string][]byte{"pages-1.img": noise(3<<20, 1), "inventory.img": []byte("inventory")}
	if _, err := dedupIn(ctx, loc, "a", files); err != nil {
		t.Fatal(err)
	}
	reached, release := make(chan struct{}), make(chan struct{})
	dst := &gatedStore{Store: store.Sub(loc, "b"), gate: func() { close(reached); <-release }}
	copied := make(chan error, 1)
	watch := &gcWatch{Store: loc, locked: func() {
		go func() {
			_, err := Copy(ctx, store.Sub(loc, "a"), dst, pipeline.Options{}, nil)
			copied <- err
		}()
		select {
		case <-reached: // verified, about to write its manifest
		case err := <-copied:
			copied <- err
			return
		}
		if _, err := Remove(ctx, store.Sub(loc, "a"), "a", false); err != nil {
			t.Error(err)
		}
	}}
	res, err := GC(ctx, watch, "loc", 0, false, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("gc: %+v", res.Chunks)
	close(release)
	err = <-copied
	if err == nil {
		verifyIn(t, store.Sub(loc, "b"), files)
		t.Fatal("cp shared the packs of a location a gc held, and committed")
	}
	if !strings.Contains(err.Error(), "a gc holds") {
		t.Fatalf("cp beside a gc failed, not saying a gc holds the location: %v", err)
	}
	if _, err := loc.Stat(ctx, "b/"+manifest.ManifestName); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("cp refused, and b has a manifest (%v)", err)
	}
	t.Logf("cp refused: %v", err)
}
