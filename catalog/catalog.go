// Package catalog manages the checkpoints under a location (a local
// directory or an S3 prefix): List the complete ones, Remove one, GC what
// unfinished captures left. It works on any store.Store; what only some
// backends have (temporary files, incomplete uploads, directories) it
// reaches through small interfaces.
//
// A checkpoint is a prefix holding segment objects (manifest.SegmentName)
// and, once complete, manifest.ManifestName. Captures that raced to one
// prefix, or failed there, may have left segments of their own beside
// them (each capture names its segments by its stream id): a checkpoint is
// exactly the segments its manifest names. A capture in flight holds a
// lock beside its segments (manifest.CaptureLockName), which is no part
// of the checkpoint.
package catalog

import (
	"context"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
)

// Backend-specific extras, found on the store by interface.
type (
	// tempRemover is a store whose dead writers leave temporary files that
	// no listing shows (store/dir); it removes only what ours recognises.
	tempRemover interface {
		RemoveTemp(ctx context.Context, cutoff time.Time, dryRun bool, ours func(name string) bool) ([]string, error)
	}
	// incompleteRemover is a store whose dead writers leave uploads that
	// no listing shows (store/s3's multipart uploads), started before
	// cutoff by the store's clock; it removes only what ours recognises.
	incompleteRemover interface {
		RemoveIncomplete(ctx context.Context, prefix string, cutoff time.Time, ours func(name string) bool) (int, error)
	}
	// dirRemover is a store that keeps directories its objects leave
	// empty (store/dir).
	dirRemover interface {
		RemoveEmptyDirs(prefixes ...string)
	}
)

// parallel is how many objects are read or deleted at once.
const parallel = 8

// Entry is one complete checkpoint.
type Entry struct {
	Name     string    `json:"name"`
	Location string    `json:"location"`
	Created  time.Time `json:"created,omitzero"`
	Host     string    `json:"host,omitempty"`
	Tool     string    `json:"tool,omitempty"`
	CRIU     string    `json:"criu_version,omitempty"`
	ID       string    `json:"id,omitempty"`
	// PID and Cmdline are of the checkpointed process, where recorded.
	PID      int      `json:"pid,omitempty"`
	Cmdline  []string `json:"cmdline,omitempty"`
	Files    int      `json:"files"`
	Segments int      `json:"segments"`
	RawBytes int64    `json:"raw_bytes"`
	// StoredBytes are its chunks as stored (compressed, encrypted), as
	// inspect shows them (manifest.Stats): the manifest and the segments'
	// frame headers and indexes come on top. For a deduplicated checkpoint
	// (Dedup) they count every chunk it references, shared or not. Where
	// the manifest cannot be read (Error), the bytes of its objects.
	StoredBytes int64 `json:"stored_bytes"`
	// NewBytes is what the checkpoint added: StoredBytes, or for a
	// deduplicated one the chunks it added to the location's chunk store
	// (what inspect calls new).
	NewBytes int64   `json:"new_bytes"`
	Dedup    bool    `json:"dedup,omitempty"`
	Ratio    float64 `json:"ratio"`
	// Error says why the manifest could not be read.
	Error string `json:"error,omitempty"`
}

// Problem is an object or checkpoint and what is wrong with it.
type Problem struct {
	Name  string `json:"name"`
	Error string `json:"error"`
}

// Join names a checkpoint under a location, for messages and results.
func Join(where, name string) string {
	where = strings.TrimRight(where, "/")
	if name == "" {
		return where
	}
	return where + "/" + name
}

// List returns the complete checkpoints in st, oldest first; where names
// st's location in the entries.
func List(ctx context.Context, st store.Store, where string) ([]Entry, error) {
	objs, err := st.List(ctx, "")
	if err != nil {
		return nil, err
	}
	var complete []*group
	for _, g := range groups(objs) {
		if g.manifest != nil {
			complete = append(complete, g)
		}
	}
	entries := make([]Entry, len(complete))
	var wg sync.WaitGroup
	sem := make(chan struct{}, parallel)
	for i, g := range complete {
		name := strings.TrimSuffix(g.prefix, "/")
		entries[i] = Entry{Name: name, Location: Join(where, name), StoredBytes: g.bytes, Segments: len(g.segments)}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			entries[i].read(ctx, store.Sub(st, g.prefix))
		}()
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	sort.SliceStable(entries, func(i, j int) bool {
		if !entries[i].Created.Equal(entries[j].Created) {
			return entries[i].Created.Before(entries[j].Created)
		}
		return entries[i].Name < entries[j].Name
	})
	return entries, nil
}

// read fills e from its manifest: the bytes stored are of the chunks it
// names, not of other captures' leftovers beside them.
func (e *Entry) read(ctx context.Context, st store.Store) {
	m, err := source.ReadManifest(ctx, st)
	if err != nil {
		e.Error = err.Error()
		return
	}
	e.StoredBytes, e.NewBytes = m.Stats.StoredBytes, m.Stats.StoredBytes
	e.Created, e.Host, e.Tool, e.CRIU, e.ID = m.Created, m.Host, m.Tool, m.CRIUVersion, m.ID
	e.Files, e.Segments, e.RawBytes = len(m.Files), len(m.Segments), m.Stats.RawBytes
	if m.Process != nil {
		e.PID, e.Cmdline = m.Process.PID, m.Process.Cmdline
	}
	if m.SharedChunks {
		// Its segments are packs it shares: apart what it added.
		e.Dedup, e.NewBytes = true, m.Stats.NewStoredBytes
	}
	if e.StoredBytes > 0 {
		e.Ratio = float64(e.RawBytes) / float64(e.StoredBytes)
	}
}

// What an object in a checkpoint's prefix is.
type objKind int

const (
	notOurs objKind = iota
	manifestObj
	segmentObj
	lockObj // a capture's lock
)

// checkpointPrefix splits an object name into its checkpoint's prefix
// ("" or "a/b/") and what it is there: a manifest, a segment, a capture's
// lock, or none of those (notOurs).
func checkpointPrefix(name string) (prefix string, kind objKind) {
	if name == manifest.ManifestName {
		return "", manifestObj
	}
	if strings.HasSuffix(name, "/"+manifest.ManifestName) {
		return strings.TrimSuffix(name, manifest.ManifestName), manifestObj
	}
	i := strings.LastIndex(name, manifest.SegmentPrefix)
	if i < 0 || (i > 0 && name[i-1] != '/') {
		return "", notOurs
	}
	if manifest.IsSegmentName(name[i:]) {
		return name[:i], segmentObj
	}
	if _, ok := manifest.CaptureOfLock(name[i:]); ok {
		return name[:i], lockObj
	}
	return "", notOurs
}

// group is one checkpoint's objects.
type group struct {
	prefix   string
	manifest *store.ObjectInfo
	segments []store.ObjectInfo
	locks    []store.ObjectInfo // of captures
	newest   time.Time
	bytes    int64
}

// groups sorts a listing into checkpoints.
func groups(objs []store.ObjectInfo) []*group {
	byPrefix := map[string]*group{}
	var out []*group
	for i := range objs {
		o := &objs[i]
		p, kind := checkpointPrefix(o.Name)
		if kind == notOurs {
			continue
		}
		g := byPrefix[p]
		if g == nil {
			g = &group{prefix: p}
			byPrefix[p] = g
			out = append(out, g)
		}
		switch kind {
		case manifestObj:
			g.manifest = o
		case segmentObj:
			g.segments = append(g.segments, *o)
		case lockObj:
			g.locks = append(g.locks, *o)
			continue // no part of a checkpoint
		}
		g.bytes += o.Size
		if o.Modified.After(g.newest) {
			g.newest = o.Modified
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].prefix < out[j].prefix })
	return out
}
