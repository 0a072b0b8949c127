package catalog

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
)

// RemoveResult is what Remove removed (or would remove).
type RemoveResult struct {
	Location string `json:"location"`
	Objects  int    `json:"objects"`
	Bytes    int64  `json:"bytes"`
	DryRun   bool   `json:"dry_run,omitempty"`
	// Unread says why the manifest could not be read: it was removed
	// alone, its segments left for GC.
	Unread string `json:"manifest_unread,omitempty"`
}

// Remove deletes the checkpoint st holds: its manifest first, so that it
// stops being complete (listable, restorable) at once, then the segments
// its manifest names, and no others: segments beside them are another
// capture's (one still running, or one that failed, for GC). A store
// without a manifest is refused, with an error wrapping
// errdefs.ErrNotFound: it may be a capture still running; GC removes
// unfinished ones once they are old. A manifest that cannot be read is
// removed alone, and its segments left for GC (Unread says why).
func Remove(ctx context.Context, st store.Store, where string, dryRun bool) (*RemoveResult, error) {
	info, err := st.Stat(ctx, manifest.ManifestName)
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil, fmt.Errorf("%s: no complete checkpoint there (%s missing); `gpucr-stream gc` removes unfinished ones: %w",
				where, manifest.ManifestName, errdefs.ErrNotFound)
		}
		return nil, err
	}
	res := &RemoveResult{Location: where, Objects: 1, Bytes: info.Size, DryRun: dryRun}
	names, sizes, err := namedSegments(ctx, st)
	if err != nil {
		if ctx.Err() != nil {
			return nil, err
		}
		res.Unread = err.Error()
	}
	res.Objects += len(names)
	res.Bytes += sizes
	if dryRun {
		return res, nil
	}
	if err := st.Delete(ctx, manifest.ManifestName); err != nil {
		return nil, err
	}
	if n, err := removeObjects(ctx, st, names); err != nil {
		return nil, fmt.Errorf("%s is no longer a checkpoint, but %d of its %d segments remain (run gc): %w",
			where, len(names)-n, len(names), err)
	}
	if d, ok := st.(dirRemover); ok {
		d.RemoveEmptyDirs(segmentsDir(""), "") // and the checkpoint's own, if now empty
	}
	return res, nil
}

// namedSegments reads the manifest in st and returns the segments it
// names, and their size. Only segment names are taken (a manifest is not
// trusted to name other objects), each once.
func namedSegments(ctx context.Context, st store.Store) ([]string, int64, error) {
	m, err := source.ReadManifest(ctx, st)
	if err != nil {
		return nil, 0, err
	}
	var names []string
	var size int64
	seen := map[string]bool{}
	for _, s := range m.Segments {
		if manifest.IsSegmentName(s.Name) && !seen[s.Name] {
			seen[s.Name] = true
			names = append(names, s.Name)
			size += s.Size
		}
	}
	return names, size, nil
}

// segmentsDir is the prefix of a checkpoint's segments, as a directory.
func segmentsDir(prefix string) string {
	return prefix + strings.TrimSuffix(manifest.SegmentPrefix, "/")
}

// removeObjects deletes objects, a few at once; it returns how many went.
func removeObjects(ctx context.Context, st store.Store, names []string) (int, error) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	done := 0
	sem := make(chan struct{}, parallel)
	for _, n := range names {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			err := st.Delete(ctx, n)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if first == nil {
					first = err
				}
				return
			}
			done++
		}()
	}
	wg.Wait()
	return done, first
}

// GCResult is what GC removed (or would remove).
type GCResult struct {
	Location   string   `json:"location"`
	Unfinished []string `json:"unfinished"` // checkpoints whose segments were removed
	Objects    int      `json:"objects"`
	Bytes      int64    `json:"bytes"`
	// Uploads are incomplete uploads aborted, where the store has them
	// (HasUploads) and this was no dry run.
	Uploads    int  `json:"incomplete_uploads"`
	HasUploads bool `json:"-"`
	// TempFiles are temporary files of killed writers and the empty
	// directories failed checkpoints left, where the store has them
	// (HasTempFiles).
	TempFiles    int  `json:"temp_files"`
	HasTempFiles bool `json:"-"`
	// Names are the objects, temporary files and directories removed (or
	// that would be), under the location; the chunk store's are counted
	// in Chunks.
	Names []string `json:"names"`
	// Young are unfinished checkpoints left alone as younger than
	// OlderThanMS (their capture may still be running): gc with a smaller
	// --older-than takes them.
	Young       int   `json:"young_unfinished,omitempty"`
	OlderThanMS int64 `json:"older_than_ms"`
	DryRun      bool  `json:"dry_run,omitempty"`
	// Chunks is what gc did in the location's chunk store, when it has
	// one (deduplicated checkpoints).
	Chunks *ChunkGCResult `json:"chunk_store,omitempty"`
}

// GC removes what unfinished captures left in st: segments that no
// manifest names (of checkpoints that never got one, or of captures that
// lost the race to commit one beside another), and the store's own
// leftovers (incomplete uploads, temporary files), then gc's of the chunk
// store (GCChunks). Ages are by the store's clock: against gc's own lock,
// written first. What is unfinished is judged by locks: where a writer (a
// capture, a cp) holds a fresh lock beside a checkpoint's segments, it is
// running, whatever their age, and nothing under that checkpoint (nor,
// for a lock in the chunk store, under the location) is touched; else a
// capture (one killed, or of an older version, which held none) is
// unfinished once the newest of its segments is older than age, and its
// segments and stale lock go. Age 0 thus takes every leftover of a
// dead capture, and nothing of a live one. Where a manifest cannot be
// read, no segment beside it is removed: which are its own is unknown.
func GC(ctx context.Context, st store.Store, where string, age time.Duration, dryRun bool, repackBelow float64) (*GCResult, error) {
	objs, err := st.List(ctx, "")
	if err != nil {
		return nil, err
	}
	// Before gc writes its lock there.
	if err := refuseForeign(ctx, st, objs, where); err != nil {
		return nil, err
	}
	// The chunk store's candidates are of this listing, before the lock:
	// a capture that starts after it shares nothing, and writes only
	// packs this listing cannot hold.
	cs := chunkObjectsIn(objs)
	lock, err := chunkstore.TakeLock(ctx, st, chunkstore.LockGC)
	if err != nil {
		return nil, err
	}
	defer lock.Release(ctx)
	if objs, err = st.List(ctx, ""); err != nil {
		return nil, err
	}
	res := &GCResult{Location: where, Unfinished: []string{}, Names: []string{}, OlderThanMS: age.Milliseconds(), DryRun: dryRun}
	cutoff := lock.Now.Add(-age)
	for _, g := range groups(objs) {
		if len(g.segments) == 0 && len(g.locks) == 0 {
			continue
		}
		sub := store.Sub(st, g.prefix)
		named := map[string]bool{}
		if g.manifest != nil {
			names, _, err := namedSegments(ctx, sub)
			if err != nil {
				if ctx.Err() != nil {
					return nil, ctx.Err()
				}
				continue
			}
			for _, n := range names {
				named[n] = true
			}
		}
		if g.locked(ctx, st, lock.Now) {
			continue
		}
		for _, c := range leftovers(g, named) {
			if c.newest.After(cutoff) {
				res.Young++
				continue
			}
			if err := removeUnfinished(ctx, st, g.prefix, c, lock.Now, where, dryRun, res); err != nil {
				return nil, err
			}
		}
	}
	keep := inFlight(ctx, st, objs, lock.Now, lock.Name())
	removable := func(name string) bool { return ours(name) && !keep(name) }
	if s, ok := st.(incompleteRemover); ok {
		res.HasUploads = !dryRun
		if !dryRun {
			if res.Uploads, err = s.RemoveIncomplete(ctx, "", cutoff, removable); err != nil {
				return nil, err
			}
		}
	}
	if s, ok := st.(tempRemover); ok {
		res.HasTempFiles = true
		names, err := s.RemoveTemp(ctx, cutoff, dryRun, removable)
		res.TempFiles, res.Names = len(names), append(res.Names, names...)
		if err != nil {
			return nil, err
		}
	}
	res.Names = append(res.Names, lock.Stale...) // gcChunks removes them
	if res.Chunks, err = gcChunks(ctx, st, lock, cs, cutoff, dryRun, repackBelow); err != nil {
		return nil, err
	}
	if res.Chunks.Packs == 0 {
		res.Chunks = nil
	}
	return res, nil
}

// inFlight says which names may be of writes in flight, by the live locks
// in objs, of st, at now (own, gc's own, aside): every name under a
// checkpoint whose writer holds a lock beside its segments, and every name
// under a location whose chunk store a capture, cp or other gc holds (its
// packs, index objects and checkpoints' manifests).
func inFlight(ctx context.Context, st store.Store, objs []store.ObjectInfo, now time.Time, own string) func(name string) bool {
	var live []string
	for _, o := range objs {
		p, kind := checkpointPrefix(o.Name)
		if kind != lockObj {
			i := strings.LastIndex(o.Name, chunkstore.LockPrefix)
			if i < 0 || (i > 0 && o.Name[i-1] != '/') {
				continue
			}
			p = o.Name[:i]
		}
		if o.Name != own && lockLive(ctx, st, o, now) {
			live = append(live, p)
		}
	}
	return func(name string) bool {
		for _, p := range live {
			if strings.HasPrefix(name, p) {
				return true
			}
		}
		return false
	}
}

// capture is what one capture left in a checkpoint's prefix: segments and
// its lock, named relative to the prefix.
type capture struct {
	segments []store.ObjectInfo
	lock     *store.ObjectInfo
	newest   time.Time // of its segments
	bytes    int64
}

// lockLive says the lock o of st counts at now: it is fresh, and its
// holder is not known to be gone (store.HolderGone).
func lockLive(ctx context.Context, st store.Store, o store.ObjectInfo, now time.Time) bool {
	return store.Fresh(o, now) && !store.HolderGoneAt(ctx, st, o.Name)
}

// locked says a writer holds a live lock beside g's segments, in st, at
// now.
func (g *group) locked(ctx context.Context, st store.Store, now time.Time) bool {
	for _, l := range g.locks {
		if lockLive(ctx, st, l, now) {
			return true
		}
	}
	return false
}

// lockedNow is locked of the checkpoint in st, listed again.
func lockedNow(ctx context.Context, st store.Store, now time.Time) (bool, error) {
	objs, err := st.List(ctx, manifest.SegmentPrefix)
	if err != nil {
		return false, err
	}
	g := &group{}
	for _, o := range objs {
		if _, ok := manifest.CaptureOfLock(o.Name); ok {
			g.locks = append(g.locks, o)
		}
	}
	return g.locked(ctx, st, now), nil
}

// leftovers sorts g's segments that named leaves out, and its captures'
// locks, by the capture that wrote them, in name order.
func leftovers(g *group, named map[string]bool) []*capture {
	by := map[string]*capture{}
	var out []*capture
	of := func(id string) *capture {
		c := by[id]
		if c == nil {
			c = &capture{}
			by[id] = c
			out = append(out, c)
		}
		return c
	}
	for _, s := range g.segments {
		s.Name = strings.TrimPrefix(s.Name, g.prefix)
		if named[s.Name] {
			continue
		}
		id, _ := manifest.SegmentCapture(s.Name)
		c := of(id)
		c.segments = append(c.segments, s)
		c.bytes += s.Size
		if s.Modified.After(c.newest) {
			c.newest = s.Modified
		}
	}
	for _, l := range g.locks {
		l.Name = strings.TrimPrefix(l.Name, g.prefix)
		id, _ := manifest.CaptureOfLock(l.Name)
		of(id).lock = &l
	}
	return out
}

// removeUnfinished removes c, an unfinished capture's segments and lock
// under prefix, unless a writer holds a fresh lock there at now after all
// (a listing may miss an object written meanwhile), except any segment
// that a manifest committed since the listing names.
func removeUnfinished(ctx context.Context, st store.Store, prefix string, c *capture, now time.Time, where string, dryRun bool, res *GCResult) error {
	sub := store.Sub(st, prefix)
	if locked, err := lockedNow(ctx, sub, now); err != nil || locked {
		return err
	}
	named := map[string]bool{}
	if _, err := sub.Stat(ctx, manifest.ManifestName); err == nil {
		names, _, err := namedSegments(ctx, sub)
		if err != nil {
			return nil // unreadable now: leave it all
		}
		for _, n := range names {
			named[n] = true
		}
	} else if !errors.Is(err, errdefs.ErrNotFound) {
		return err
	}
	var names []string
	var bytes int64
	for _, s := range c.segments {
		if !named[s.Name] {
			names = append(names, s.Name)
			bytes += s.Size
			res.Names = append(res.Names, prefix+s.Name)
		}
	}
	if c.lock != nil {
		bytes += c.lock.Size
		res.Names = append(res.Names, prefix+c.lock.Name)
	}
	if len(names) == 0 && c.lock == nil {
		return nil
	}
	name := Join(where, strings.TrimSuffix(prefix, "/"))
	if !dryRun {
		// The lock first: a holder taken for dead that lives on finds it
		// gone, a lapse, and commits nothing.
		if c.lock != nil {
			if err := sub.Delete(ctx, c.lock.Name); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
		}
		if _, err := removeObjects(ctx, sub, names); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		if d, ok := st.(dirRemover); ok {
			dirs := []string{segmentsDir(prefix)}
			if prefix != "" {
				dirs = append(dirs, strings.TrimSuffix(prefix, "/")) // never the location itself
			}
			d.RemoveEmptyDirs(dirs...)
		}
	}
	if n := len(res.Unfinished); len(names) > 0 && (n == 0 || res.Unfinished[n-1] != name) {
		res.Unfinished = append(res.Unfinished, name)
	}
	res.Objects += len(names)
	if c.lock != nil {
		res.Objects++
	}
	res.Bytes += bytes
	return nil
}
