package catalog

// GC of a location's chunk store (docs/FORMAT.md section 17.5): mark the
// frames the manifests of the location's checkpoints use (found as a
// reader finds them: chunkstore.Relocate), sweep the packs with none,
// repack those mostly garbage (chunkstore.Marks.Repack, into packs that
// streamer.PackWriter writes), and rewrite the index. It runs under a gc
// lock and only when no capture holds one (chunkstore/lock.go): a capture
// in flight may reference any pack its index listed, or write packs no
// manifest names yet. A manifest that cannot be read stops the sweep: what
// it references is unknown. So does, for the chunk store, an index object
// that cannot be read when a manifest needs the index to find its chunks
// (they were repacked): they may lie in any pack that object described.
// Otherwise every referenced frame is marked where it lies, with or
// without the index, and gc goes on, leaving the bad object to check.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/streamer"
)

// ChunkGCResult is what GCChunks removed (or would remove).
type ChunkGCResult struct {
	Packs        int   `json:"packs"`         // packs in the location
	Referenced   int   `json:"referenced"`    // packs a manifest's chunks lie in
	Removed      int   `json:"removed_packs"` // unreferenced packs removed
	RemovedBytes int64 `json:"removed_bytes"`
	// Young are unreferenced packs left alone as younger than the age gc
	// was given (a capture may be about to reference them: after rm, the
	// packs only the removed checkpoint used).
	Young      int   `json:"young_packs,omitempty"`
	YoungBytes int64 `json:"young_bytes,omitempty"`
	// Repacked packs were mostly garbage: their live chunks were copied
	// into RepackedInto new packs (RepackedBytes) and they were removed.
	Repacked      int   `json:"repacked_packs,omitempty"`
	RepackedInto  int   `json:"repacked_into,omitempty"`
	RepackedBytes int64 `json:"repacked_bytes,omitempty"`
	// IndexObjects are the index objects replaced by one.
	IndexObjects int `json:"index_objects_replaced"`
	// Lost are checkpoints with chunks in no pack (damaged before).
	Lost []string `json:"lost,omitempty"`
	// BadIndex are the index objects that could not be read (corrupt or
	// truncated), each with what is wrong: gc left them in place.
	BadIndex []Problem `json:"bad_index,omitempty"`
	// Unresolved are checkpoints whose chunks are in packs the manifest
	// no longer names and that the readable index objects do not find:
	// with BadIndex, gc then cannot tell which packs hold them, and
	// removed nothing (Skipped).
	Unresolved []string `json:"unresolved,omitempty"`
	// Skipped says why nothing was removed (another holds a lock, or
	// Unresolved).
	Skipped string `json:"skipped,omitempty"`
	DryRun  bool   `json:"dry_run,omitempty"`
}

// RepackShare is the default share of a pack its live frames must fill
// for gc to keep it as it is: below, gc repacks it.
const RepackShare = 0.5

// repackSize is the size of the packs repacking writes.
const repackSize = 256 << 20

// GCChunks removes the packs of st's chunk store that no checkpoint's
// chunks lie in and that are older than age, repacks those older than age
// whose live frames fill less than repackBelow of them (0: RepackShare;
// negative: none), then replaces the index objects by one listing the
// chunks of the packs that remain. Ages are by the store's clock, against
// its lock.
func GCChunks(ctx context.Context, st store.Store, age time.Duration, dryRun bool, repackBelow float64) (*ChunkGCResult, error) {
	objs, err := st.List(ctx, chunkstore.Dir)
	if err != nil {
		return nil, err
	}
	cs := chunkObjectsIn(objs)
	if len(cs.packs) == 0 && len(cs.indexes) == 0 {
		return &ChunkGCResult{DryRun: dryRun}, nil
	}
	lock, err := chunkstore.TakeLock(ctx, st, chunkstore.LockGC)
	if err != nil {
		return nil, err
	}
	defer lock.Release(ctx)
	return gcChunks(ctx, st, lock, cs, lock.Now.Add(-age), dryRun, repackBelow)
}

// chunkObjects are a chunk store's packs and index objects, as listed.
type chunkObjects struct {
	packs   []store.ObjectInfo
	indexes []string
}

// chunkObjectsIn are the chunk store's objects in objs, a listing of its
// location.
func chunkObjectsIn(objs []store.ObjectInfo) chunkObjects {
	var cs chunkObjects
	for _, o := range objs {
		if _, ok := chunkstore.ParsePackName(o.Name); ok {
			cs.packs = append(cs.packs, o)
		} else if chunkstore.IsIndexName(o.Name) {
			cs.indexes = append(cs.indexes, o.Name)
		}
	}
	return cs
}

// gcChunks is GCChunks of cs, listed before lock, a gc lock of st, was
// taken; packs are old when not modified after cutoff.
func gcChunks(ctx context.Context, st store.Store, lock *chunkstore.Lock, cs chunkObjects, cutoff time.Time, dryRun bool, repackBelow float64) (*ChunkGCResult, error) {
	res := &ChunkGCResult{DryRun: dryRun}
	if !dryRun {
		// The locks of takers that died go before anything they may
		// guard: one that lives on after all finds its own gone (a lapse)
		// and commits nothing.
		if _, err := removeObjects(ctx, st, lock.Stale); err != nil {
			return nil, fmt.Errorf("remove stale locks: %w", err)
		}
	}
	if repackBelow == 0 {
		repackBelow = RepackShare
	}
	packs, indexes := cs.packs, cs.indexes
	res.Packs = len(packs)
	if len(packs) == 0 && len(indexes) == 0 {
		return res, nil
	}
	if held := lock.Held(); len(held) > 0 {
		res.Skipped = fmt.Sprintf("%d capture, check or gc lock(s) held in %s (%v); nothing removed", len(held), chunkstore.LockPrefix, held)
		return res, nil
	}
	// The listing again, now that no capture can start sharing: packs
	// written before the lock are all in it.
	objs, err := st.List(ctx, "")
	if err != nil {
		return nil, err
	}
	present := chunkstore.PacksIn(objs)
	t, err := chunkstore.Load(ctx, st)
	if err != nil {
		return nil, err
	}
	bad := map[string]bool{}
	for _, b := range t.Skipped() {
		bad[b.Name] = true
		res.BadIndex = append(res.BadIndex, Problem{Name: b.Name, Error: b.Err.Error()})
	}
	marks, err := markFrames(ctx, st, objs, t, present, res)
	if err != nil {
		return nil, err
	}
	if len(bad) > 0 && len(res.Lost) > 0 {
		// Their chunks may be in any pack an unreadable index object
		// described: deleting or repacking one could lose them.
		res.Unresolved, res.Lost = res.Lost, nil
		res.Skipped = fmt.Sprintf("%d index object(s) cannot be read, and %d checkpoint(s) have chunks that the other index objects do not find: which packs hold them is unknown, so nothing was removed; `gpucr-stream check --repair-index` rebuilds the index from the packs",
			len(bad), len(res.Unresolved))
		return res, nil
	}
	// Every chunk a manifest references is marked where it lies; the
	// chunks only an unreadable object listed then matter only to
	// captures (stored again) and check, which rebuilds them. It stays
	// for check to replace: it is evidence, and gc only replaces what it
	// read.
	indexes = slices.DeleteFunc(indexes, func(n string) bool { return bad[n] })
	doomed, repack, gone := pickPacks(packs, marks.Live(), cutoff, repackBelow, res)
	if dryRun || (len(doomed) == 0 && len(repack) == 0 && len(indexes) <= 1) {
		return res, nil
	}
	// Repacked chunks first, in new packs, then the index that lists them:
	// until the old index objects and packs go, both copies are readable.
	if len(repack) > 0 {
		for _, n := range repack {
			id, _ := chunkstore.ParsePackName(n)
			gone[id] = true
		}
		w, err := streamer.NewPackWriter(st, repackSize)
		if err != nil {
			return nil, err
		}
		if res.RepackedInto, err = marks.Repack(ctx, st, repack, w); err != nil {
			return nil, err
		}
	}
	if _, err := chunkstore.WriteTableIndex(ctx, st, t, func(p chunkstore.PackID) bool { return !gone[p] }, marks.Extra()); err != nil {
		return nil, err
	}
	res.IndexObjects = len(indexes)
	if _, err := removeObjects(ctx, st, indexes); err != nil {
		return nil, fmt.Errorf("remove replaced index objects: %w", err)
	}
	if _, err := removeObjects(ctx, st, append(doomed, repack...)); err != nil {
		return nil, fmt.Errorf("remove unreferenced and repacked packs: %w", err)
	}
	return res, nil
}

// pickPacks sorts packs, of which live says the bytes of live frames, into
// those to delete (doomed: none live) and to repack (live frames fill less
// than repackBelow of them), of those not modified after cutoff, counting
// them in res; gone are the packs of both.
func pickPacks(packs []store.ObjectInfo, live map[chunkstore.PackID]int64, cutoff time.Time, repackBelow float64, res *ChunkGCResult) (doomed, repack []string, gone map[chunkstore.PackID]bool) {
	gone = map[chunkstore.PackID]bool{}
	for _, p := range packs {
		id, _ := chunkstore.ParsePackName(p.Name)
		bytes, used := live[id]
		if used {
			res.Referenced++
		}
		if p.Modified.After(cutoff) {
			if !used {
				res.Young++
				res.YoungBytes += p.Size
			}
			continue
		}
		if !used {
			doomed = append(doomed, p.Name)
			gone[id] = true
			res.Removed++
			res.RemovedBytes += p.Size
			continue
		}
		if float64(bytes) < repackBelow*float64(p.Size) {
			repack = append(repack, p.Name)
			res.Repacked++
			res.RepackedBytes += bytes
		}
	}
	return doomed, repack, gone
}

// manifestBudget bounds the bytes of the manifests markFrames reads at
// once, besides their number: a manifest takes about three times its size
// while it is read and parsed, and a checkpoint of 40,000 chunks (13 GB of
// device memory) has one of 8 MB. A larger one is read alone.
const manifestBudget = 4 << 20

// markFrames reads every manifest in objs and marks, in the packs its
// chunks lie in (through the index t where a manifest's pack is gone:
// chunkstore.Relocate, as a reader finds them), the frames they use. Any
// manifest it cannot read is an error: its references are unknown. A
// checkpoint with chunks in no pack is reported in res.Lost. What it holds
// besides the marks (a bit per chunk of t) is the manifests in flight
// (eachManifest).
func markFrames(ctx context.Context, st store.Store, objs []store.ObjectInfo, t *chunkstore.Table, present map[chunkstore.PackID]int64, res *ChunkGCResult) (*chunkstore.Marks, error) {
	marks := t.NewMarks()
	var mu sync.Mutex
	err := eachManifest(ctx, st, objs, func(p string, m *manifest.Manifest, err error) error {
		name := Join(st.String(), strings.TrimSuffix(p, "/"))
		if err == nil && m.SharedChunks {
			err = chunkstore.Relocate(m, t, present)
			if errors.Is(err, errdefs.ErrNotFound) {
				mu.Lock()
				res.Lost = append(res.Lost, name)
				mu.Unlock()
				return nil
			}
		}
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil // removed since the listing: it references nothing
		}
		if err != nil {
			return fmt.Errorf("gc of the chunk store stops: the manifest of %s cannot be read, so which packs it references is unknown: %w", name, err)
		}
		if !m.SharedChunks {
			return nil
		}
		mu.Lock()
		defer mu.Unlock()
		marks.MarkManifest(m)
		return nil
	})
	return marks, err
}

// eachManifest reads the manifest of every complete checkpoint in objs,
// parallel of them at once and manifestBudget bytes at most (a larger one
// alone), and calls fn, from several goroutines, with the checkpoint's
// prefix and the manifest or why it could not be read. The first error fn
// returns is eachManifest's; the others still run.
func eachManifest(ctx context.Context, st store.Store, objs []store.ObjectInfo, fn func(prefix string, m *manifest.Manifest, err error) error) error {
	var mu sync.Mutex
	reading := sync.NewCond(&mu)
	var inFlight int64 // bytes of the manifests being read
	var first error
	var wg sync.WaitGroup
	sem := make(chan struct{}, parallel)
	for _, g := range groups(objs) {
		if g.manifest == nil {
			continue
		}
		p, n := g.prefix, min(g.manifest.Size, manifestBudget)
		sem <- struct{}{}
		mu.Lock()
		for inFlight > 0 && inFlight+n > manifestBudget {
			reading.Wait()
		}
		inFlight += n
		mu.Unlock()
		wg.Go(func() {
			defer func() {
				mu.Lock()
				inFlight -= n
				reading.Broadcast()
				mu.Unlock()
				<-sem
			}()
			m, err := source.ReadManifest(ctx, store.Sub(st, p))
			if err := fn(p, m, err); err != nil {
				mu.Lock()
				if first == nil {
					first = err
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return first
}
