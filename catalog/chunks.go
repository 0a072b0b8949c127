package catalog

// GC of a location's chunk store (docs/FORMAT.md section 17.5): mark the
// packs that the manifests of the location's checkpoints name, sweep the
// others, and rewrite the index without them. It runs under a gc lock and
// only when no capture holds one (chunkstore/lock.go): a capture in flight
// may reference any pack its index listed, or write packs no manifest
// names yet. A manifest that cannot be read stops the sweep: what it
// references is unknown.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
)

// ChunkGCResult is what GCChunks removed (or would remove).
type ChunkGCResult struct {
	Packs        int   `json:"packs"`         // packs in the location
	Referenced   int   `json:"referenced"`    // packs a manifest names
	Removed      int   `json:"removed_packs"` // unreferenced packs removed
	RemovedBytes int64 `json:"removed_bytes"`
	// IndexObjects are the index objects replaced by one.
	IndexObjects int `json:"index_objects_replaced"`
	// Skipped says why nothing was removed (a capture holds a lock).
	Skipped string `json:"skipped,omitempty"`
	DryRun  bool   `json:"dry_run,omitempty"`
}

// GCChunks removes the packs of st's chunk store that no checkpoint's
// manifest names and that are older than age, then replaces the index
// objects by one listing the chunks of the packs that remain.
func GCChunks(ctx context.Context, st store.Store, age time.Duration, dryRun bool) (*ChunkGCResult, error) {
	res := &ChunkGCResult{DryRun: dryRun}
	objs, err := st.List(ctx, chunkstore.Dir)
	if err != nil {
		return nil, err
	}
	var packs []store.ObjectInfo
	var indexes []string
	for _, o := range objs {
		if _, ok := chunkstore.ParsePackName(o.Name); ok {
			packs = append(packs, o)
		} else if chunkstore.IsIndexName(o.Name) {
			indexes = append(indexes, o.Name)
		}
	}
	res.Packs = len(packs)
	if len(packs) == 0 && len(indexes) == 0 {
		return res, nil
	}
	lock, err := chunkstore.TakeLock(ctx, st, chunkstore.LockGC)
	if err != nil {
		return nil, err
	}
	defer lock.Release(ctx)
	if n := len(lock.Others[chunkstore.LockCapture]) + len(lock.Others[chunkstore.LockGC]); n > 0 {
		res.Skipped = fmt.Sprintf("%d capture or gc lock(s) held in %s (%v); nothing removed", n, chunkstore.LockPrefix, append(lock.Others[chunkstore.LockCapture], lock.Others[chunkstore.LockGC]...))
		return res, nil
	}
	// The listing again, now that no capture can start sharing: packs
	// written before the lock are all in it.
	if objs, err = st.List(ctx, ""); err != nil {
		return nil, err
	}
	live, err := referencedPacks(ctx, st, objs)
	if err != nil {
		return nil, err
	}
	cutoff := time.Now().Add(-age)
	var doomed []string
	gone := map[chunkstore.PackID]bool{}
	for _, p := range packs {
		id, _ := chunkstore.ParsePackName(p.Name)
		if live[id] {
			res.Referenced++
			continue
		}
		if p.Modified.After(cutoff) {
			continue
		}
		doomed = append(doomed, p.Name)
		gone[id] = true
		res.Removed++
		res.RemovedBytes += p.Size
	}
	if dryRun || (len(doomed) == 0 && len(indexes) <= 1) {
		return res, nil
	}
	// The new index first: until the old ones go, both list the live
	// chunks, and a crash in between leaves a valid (larger) index.
	if err := rewriteIndex(ctx, st, gone); err != nil {
		return nil, err
	}
	res.IndexObjects = len(indexes)
	if _, err := removeObjects(ctx, st, indexes); err != nil {
		return nil, fmt.Errorf("remove replaced index objects: %w", err)
	}
	if _, err := removeObjects(ctx, st, doomed); err != nil {
		return nil, fmt.Errorf("remove unreferenced packs: %w", err)
	}
	return res, nil
}

// referencedPacks reads every manifest in objs and returns the packs they
// name. Any manifest it cannot read is an error: its references are unknown.
func referencedPacks(ctx context.Context, st store.Store, objs []store.ObjectInfo) (map[chunkstore.PackID]bool, error) {
	var prefixes []string
	for _, g := range groups(objs) {
		if g.manifest != nil {
			prefixes = append(prefixes, g.prefix)
		}
	}
	live := map[chunkstore.PackID]bool{}
	var mu sync.Mutex
	var first error
	var wg sync.WaitGroup
	sem := make(chan struct{}, parallel)
	for _, p := range prefixes {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			m, err := source.ReadManifest(ctx, store.Sub(st, p))
			mu.Lock()
			defer mu.Unlock()
			if errors.Is(err, errdefs.ErrNotFound) {
				return // removed since the listing: it references nothing
			}
			if err != nil {
				if first == nil {
					first = fmt.Errorf("gc of the chunk store stops: the manifest of %s cannot be read, so which packs it references is unknown: %w", Join(st.String(), p), err)
				}
				return
			}
			if !m.SharedChunks {
				return
			}
			for _, s := range m.Segments {
				if id, ok := chunkstore.ParsePackName(s.Name); ok {
					live[id] = true
				}
			}
		}()
	}
	wg.Wait()
	return live, first
}

// rewriteIndex writes one index object listing every chunk of the current
// index that is not in a pack of gone.
func rewriteIndex(ctx context.Context, st store.Store, gone map[chunkstore.PackID]bool) error {
	t, err := chunkstore.Load(ctx, st)
	if err != nil {
		return err
	}
	if t.Len() == 0 {
		return nil
	}
	_, err = chunkstore.WriteTableIndex(ctx, st, t, func(p chunkstore.PackID) bool { return !gone[p] })
	return err
}
