package catalog

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store"
)

// RemoveResult is what Remove removed (or would remove).
type RemoveResult struct {
	Location string `json:"location"`
	Objects  int    `json:"objects"`
	Bytes    int64  `json:"bytes"`
	DryRun   bool   `json:"dry_run,omitempty"`
}

// Remove deletes the checkpoint st holds: its manifest first, so that it
// stops being complete (listable, restorable) at once, then its segments.
// A store without a manifest is refused, with an error wrapping
// errdefs.ErrNotFound: it may be a capture still running; GC removes
// unfinished ones once they are old.
func Remove(ctx context.Context, st store.Store, where string, dryRun bool) (*RemoveResult, error) {
	info, err := st.Stat(ctx, manifest.ManifestName)
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil, fmt.Errorf("%s: no complete checkpoint there (%s missing); `gpucr-stream gc` removes unfinished ones: %w",
				where, manifest.ManifestName, errdefs.ErrNotFound)
		}
		return nil, err
	}
	segs, err := st.List(ctx, manifest.SegmentPrefix)
	if err != nil {
		return nil, err
	}
	res := &RemoveResult{Location: where, Objects: 1, Bytes: info.Size, DryRun: dryRun}
	var names []string
	for _, s := range segs {
		if manifest.IsSegmentName(s.Name) {
			names = append(names, s.Name)
			res.Objects++
			res.Bytes += s.Size
		}
	}
	if dryRun {
		return res, nil
	}
	if err := st.Delete(ctx, manifest.ManifestName); err != nil {
		return nil, err
	}
	if n, err := removeObjects(ctx, st, names); err != nil {
		return nil, fmt.Errorf("%s is no longer a checkpoint, but %d of its %d segments remain (run rm or gc again): %w",
			where, len(names)-n, len(names), err)
	}
	if d, ok := st.(dirRemover); ok {
		d.RemoveEmptyDirs(segmentsDir(""), "") // and the checkpoint's own, if now empty
	}
	return res, nil
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
	TempFiles    int   `json:"temp_files"`
	HasTempFiles bool  `json:"-"`
	OlderThanMS  int64 `json:"older_than_ms"`
	DryRun       bool  `json:"dry_run,omitempty"`
}

// GC removes what unfinished captures left in st: segments of checkpoints
// that never got a manifest, once the newest of them is older than age (a
// capture still running writes one at least every segment), and the
// store's own leftovers (incomplete uploads, temporary files) that old.
func GC(ctx context.Context, st store.Store, where string, age time.Duration, dryRun bool) (*GCResult, error) {
	objs, err := st.List(ctx, "")
	if err != nil {
		return nil, err
	}
	res := &GCResult{Location: where, Unfinished: []string{}, OlderThanMS: age.Milliseconds(), DryRun: dryRun}
	cutoff := time.Now().Add(-age)
	for _, g := range groups(objs) {
		if g.manifest != nil || len(g.segments) == 0 || g.newest.After(cutoff) {
			continue
		}
		if err := removeUnfinished(ctx, st, g, where, dryRun, res); err != nil {
			return nil, err
		}
	}
	if s, ok := st.(incompleteRemover); ok {
		res.HasUploads = !dryRun
		if !dryRun {
			if res.Uploads, err = s.RemoveIncomplete(ctx, "", age); err != nil {
				return nil, err
			}
		}
	}
	if s, ok := st.(tempRemover); ok {
		res.HasTempFiles = true
		if res.TempFiles, err = s.RemoveTemp(ctx, cutoff, dryRun); err != nil {
			return nil, err
		}
	}
	return res, nil
}

// removeUnfinished removes the segments of g, an unfinished checkpoint,
// unless it has committed since the listing.
func removeUnfinished(ctx context.Context, st store.Store, g *group, where string, dryRun bool, res *GCResult) error {
	sub := store.Sub(st, g.prefix)
	if _, err := sub.Stat(ctx, manifest.ManifestName); err == nil {
		return nil
	} else if !errors.Is(err, errdefs.ErrNotFound) {
		return err
	}
	var names []string
	for _, s := range g.segments {
		names = append(names, strings.TrimPrefix(s.Name, g.prefix))
	}
	name := Join(where, strings.TrimSuffix(g.prefix, "/"))
	if !dryRun {
		if _, err := removeObjects(ctx, sub, names); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		if d, ok := st.(dirRemover); ok {
			dirs := []string{segmentsDir(g.prefix)}
			if g.prefix != "" {
				dirs = append(dirs, strings.TrimSuffix(g.prefix, "/")) // never the location itself
			}
			d.RemoveEmptyDirs(dirs...)
		}
	}
	res.Unfinished = append(res.Unfinished, name)
	res.Objects += len(names)
	res.Bytes += g.bytes
	return nil
}
