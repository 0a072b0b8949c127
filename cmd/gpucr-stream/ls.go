package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/redact"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/s3"
	"github.com/gpucr/gpucr-stream/streamer"
)

// A location (s3://BUCKET/PREFIX or a local directory) holds checkpoints:
// each is a prefix with segments/NNNNNNNN.gcs objects and, once complete,
// manifest.json. ls lists the complete ones, rm deletes one, gc removes what
// unfinished captures left.

// storeAt opens the st of an archive location for ls, rm and gc.
func storeAt(ctx context.Context, cfg *config, cmd, where string) (store.Store, location.Location, func(), error) {
	loc, err := location.Parse(where)
	if err != nil {
		return nil, loc, nil, usagef("%s: %v", cmd, err)
	}
	switch loc.Kind {
	case location.S3:
		s, err := openS3(ctx, cfg, loc)
		if err != nil {
			return nil, loc, nil, err
		}
		return s, loc, func() { s.Close() }, nil
	case location.Archive:
		st, err := os.Stat(loc.Path)
		if err != nil {
			return nil, loc, nil, fmt.Errorf("%s: %w", loc, errdefs.ErrNotFound)
		}
		if !st.IsDir() {
			return nil, loc, nil, usagef("%s %s: not a directory", cmd, loc)
		}
		return dir.New(loc.Path), loc, func() {}, nil
	case location.StreamFile:
		return nil, loc, nil, usagef("%s %s: a stream file holds one checkpoint and is not a location; use inspect", cmd, loc)
	}
	return nil, loc, nil, usagef("%s: want s3://BUCKET/PREFIX or a directory, got %s", cmd, loc)
}

func oneArg(cmd string, args []string) (string, error) {
	if len(args) != 1 {
		return "", usagef("%s takes one LOCATION argument, got %d", cmd, len(args))
	}
	return args[0], nil
}

// joinLoc names a checkpoint under a location, for messages and JSON.
func joinLoc(loc location.Location, name string) string {
	raw := strings.TrimRight(redact.URL(loc.Raw), "/")
	if name == "" {
		return raw
	}
	return raw + "/" + name
}

type lsEntry struct {
	Name        string    `json:"name"`
	Location    string    `json:"location"`
	Created     time.Time `json:"created,omitzero"`
	Host        string    `json:"host,omitempty"`
	Tool        string    `json:"tool,omitempty"`
	CRIU        string    `json:"criu_version,omitempty"`
	ID          string    `json:"id,omitempty"`
	Files       int       `json:"files"`
	Segments    int       `json:"segments"`
	RawBytes    int64     `json:"raw_bytes"`
	StoredBytes int64     `json:"stored_bytes"` // bytes in storage: segments and manifest
	Ratio       float64   `json:"ratio"`
	Error       string    `json:"error,omitempty"`
}

var segmentRE = regexp.MustCompile(`^segments/[0-9]{8}\.gcs$`)

// checkpointPrefix splits an object name into its checkpoint's prefix
// ("" or "a/b/") and the name inside it, for manifests and segments.
func checkpointPrefix(name string) (prefix string, ok bool, isManifest bool) {
	if name == manifest.ManifestName {
		return "", true, true
	}
	if strings.HasSuffix(name, "/"+manifest.ManifestName) {
		return strings.TrimSuffix(name, manifest.ManifestName), true, true
	}
	i := strings.LastIndex(name, "segments/")
	if i < 0 || (i > 0 && name[i-1] != '/') || !segmentRE.MatchString(name[i:]) {
		return "", false, false
	}
	return name[:i], true, false
}

type group struct {
	prefix   string
	manifest *store.ObjectInfo
	segments []store.ObjectInfo
	newest   time.Time
	bytes    int64
}

// groups sorts a listing into checkpoints.
func groups(objs []store.ObjectInfo) []*group {
	byPrefix := map[string]*group{}
	var out []*group
	for i := range objs {
		o := &objs[i]
		p, ok, isMan := checkpointPrefix(o.Name)
		if !ok {
			continue
		}
		g := byPrefix[p]
		if g == nil {
			g = &group{prefix: p}
			byPrefix[p] = g
			out = append(out, g)
		}
		if isMan {
			g.manifest = o
		} else {
			g.segments = append(g.segments, *o)
		}
		g.bytes += o.Size
		if o.Modified.After(g.newest) {
			g.newest = o.Modified
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].prefix < out[j].prefix })
	return out
}

func runLs(ctx context.Context, cfg *config, args []string) error {
	where, err := oneArg("ls", args)
	if err != nil {
		return err
	}
	st, loc, closeStore, err := storeAt(ctx, cfg, "ls", where)
	if err != nil {
		return fmt.Errorf("ls: %w", err)
	}
	defer closeStore()
	objs, err := st.List(ctx, "")
	if err != nil {
		return fmt.Errorf("ls: %w", err)
	}
	var complete []*group
	for _, g := range groups(objs) {
		if g.manifest != nil {
			complete = append(complete, g)
		}
	}
	entries := make([]lsEntry, len(complete))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i, g := range complete {
		name := strings.TrimSuffix(g.prefix, "/")
		entries[i] = lsEntry{Name: name, Location: joinLoc(loc, name), StoredBytes: g.bytes, Segments: len(g.segments)}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			e := &entries[i]
			m, err := streamer.ReadManifest(ctx, store.Sub(st, g.prefix))
			if err != nil {
				e.Error = err.Error()
				return
			}
			e.Created, e.Host, e.Tool, e.CRIU, e.ID = m.Created, m.Host, m.Tool, m.CRIUVersion, m.ID
			e.Files, e.Segments, e.RawBytes = len(m.Files), len(m.Segments), m.Stats.RawBytes
			if e.StoredBytes > 0 {
				e.Ratio = float64(e.RawBytes) / float64(e.StoredBytes)
			}
		}()
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return err
	}
	sort.SliceStable(entries, func(i, j int) bool {
		if !entries[i].Created.Equal(entries[j].Created) {
			return entries[i].Created.Before(entries[j].Created)
		}
		return entries[i].Name < entries[j].Name
	})
	if cfg.jsonOut {
		if entries == nil {
			entries = []lsEntry{}
		}
		enc := json.NewEncoder(cfg.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(entries)
	}
	printLs(cfg.stdout, cfg.stderr, loc, entries)
	return nil
}

func printLs(w, errw io.Writer, loc location.Location, entries []lsEntry) {
	if len(entries) == 0 {
		fmt.Fprintf(errw, "no complete checkpoints in %s\n", loc)
		return
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tCREATED\tRAW\tSTORED\tRATIO\tHOST")
	for _, e := range entries {
		name := e.Name
		if name == "" {
			name = "."
		}
		if e.Error != "" {
			fmt.Fprintf(tw, "%s\t?\t?\t%s\t?\t?\n", name, humanBytes(e.StoredBytes))
			fmt.Fprintf(errw, "gpucr-stream: ls: %s: %s\n", e.Location, e.Error)
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%.2fx\t%s\n", name, e.Created.Local().Format("2006-01-02 15:04:05"),
			humanBytes(e.RawBytes), humanBytes(e.StoredBytes), e.Ratio, e.Host)
	}
	tw.Flush()
}

// removeObjects deletes objects, a few at once; it returns how many went.
func removeObjects(ctx context.Context, st store.Store, names []string) (int, error) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	done := 0
	sem := make(chan struct{}, 8)
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

// pruneDirs removes the directories a local checkpoint leaves empty.
func pruneDirs(st store.Store, prefix string) {
	d, ok := st.(*dir.Store)
	if !ok {
		return
	}
	root := d.String()
	for _, p := range []string{prefix + "segments", strings.TrimSuffix(prefix, "/")} {
		if p != "" {
			os.Remove(filepath.Join(root, filepath.FromSlash(p))) // only if empty
		}
	}
}

type rmResult struct {
	Location string `json:"location"`
	Objects  int    `json:"objects"`
	Bytes    int64  `json:"bytes"`
	DryRun   bool   `json:"dry_run,omitempty"`
}

// runRm deletes one checkpoint: its manifest first, so that it stops being
// complete (listable, restorable) at once, then its segments. A location
// without a manifest is refused: it may be a capture still running; gc
// removes unfinished ones once they are old.
func runRm(ctx context.Context, cfg *config, args []string) error {
	where, err := oneArg("rm", args)
	if err != nil {
		return err
	}
	st, loc, closeStore, err := storeAt(ctx, cfg, "rm", where)
	if err != nil {
		return fmt.Errorf("rm: %w", err)
	}
	defer closeStore()
	info, err := st.Stat(ctx, manifest.ManifestName)
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return fmt.Errorf("rm: %s: no complete checkpoint there (%s missing); `gpucr-stream gc` removes unfinished ones: %w",
				loc, manifest.ManifestName, errdefs.ErrNotFound)
		}
		return fmt.Errorf("rm: %w", err)
	}
	segs, err := st.List(ctx, "segments/")
	if err != nil {
		return fmt.Errorf("rm: %w", err)
	}
	res := rmResult{Location: loc.String(), Objects: 1, Bytes: info.Size, DryRun: cfg.dryRun}
	var names []string
	for _, s := range segs {
		if segmentRE.MatchString(s.Name) {
			names = append(names, s.Name)
			res.Objects++
			res.Bytes += s.Size
		}
	}
	if !cfg.dryRun {
		if err := st.Delete(ctx, manifest.ManifestName); err != nil {
			return fmt.Errorf("rm: %w", err)
		}
		if n, err := removeObjects(ctx, st, names); err != nil {
			return fmt.Errorf("rm: %s is no longer a checkpoint, but %d of its %d segments remain (run rm or gc again): %w",
				loc, len(names)-n, len(names), err)
		}
		pruneDirs(st, "")
		if d, ok := st.(*dir.Store); ok {
			os.Remove(d.String()) // the checkpoint's directory, if now empty
		}
	}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(res)
	}
	verb := "removed"
	if cfg.dryRun {
		verb = "would remove"
	}
	fmt.Fprintf(cfg.stdout, "%s %s (%d objects, %s)\n", verb, res.Location, res.Objects, humanBytes(res.Bytes))
	return nil
}

// parseAge reads --older-than: a Go duration, or a number of days ("7d").
func parseAge(s string) (time.Duration, error) {
	if d, ok := strings.CutSuffix(strings.TrimSpace(s), "d"); ok {
		n, err := strconv.ParseFloat(d, 64)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("bad age %q", s)
		}
		return time.Duration(n * 24 * float64(time.Hour)), nil
	}
	d, err := time.ParseDuration(strings.TrimSpace(s))
	if err != nil || d < 0 {
		return 0, fmt.Errorf("bad age %q", s)
	}
	return d, nil
}

type gcResult struct {
	Location    string   `json:"location"`
	Unfinished  []string `json:"unfinished"` // checkpoints whose segments were removed
	Objects     int      `json:"objects"`
	Bytes       int64    `json:"bytes"`
	Uploads     int      `json:"incomplete_uploads"` // S3 multipart uploads aborted
	TempFiles   int      `json:"temp_files"`         // local: temporary files of killed writers
	OlderThanMS int64    `json:"older_than_ms"`
	DryRun      bool     `json:"dry_run,omitempty"`
}

// runGc removes what unfinished captures left under a location: segments
// of checkpoints that never got a manifest, once the newest of them is
// older than --older-than (a capture still running writes one at least
// every segment), S3 multipart uploads started that long ago, and the
// temporary files of a local directory.
func runGc(ctx context.Context, cfg *config, args []string) error {
	where, err := oneArg("gc", args)
	if err != nil {
		return err
	}
	age, err := parseAge(cfg.olderThan)
	if err != nil {
		return usagef("--older-than: %v (want e.g. 30m, 2h, 7d)", err)
	}
	st, loc, closeStore, err := storeAt(ctx, cfg, "gc", where)
	if err != nil {
		return fmt.Errorf("gc: %w", err)
	}
	defer closeStore()
	objs, err := st.List(ctx, "")
	if err != nil {
		return fmt.Errorf("gc: %w", err)
	}
	res := gcResult{Location: loc.String(), Unfinished: []string{}, OlderThanMS: age.Milliseconds(), DryRun: cfg.dryRun}
	cutoff := time.Now().Add(-age)
	for _, g := range groups(objs) {
		if g.manifest != nil || len(g.segments) == 0 || g.newest.After(cutoff) {
			continue
		}
		sub := store.Sub(st, g.prefix)
		// A capture may have committed since the listing: look again.
		if _, err := sub.Stat(ctx, manifest.ManifestName); err == nil {
			continue
		} else if !errors.Is(err, errdefs.ErrNotFound) {
			return fmt.Errorf("gc: %w", err)
		}
		var names []string
		for _, s := range g.segments {
			names = append(names, strings.TrimPrefix(s.Name, g.prefix))
		}
		name := joinLoc(loc, strings.TrimSuffix(g.prefix, "/"))
		if !cfg.dryRun {
			if _, err := removeObjects(ctx, sub, names); err != nil {
				return fmt.Errorf("gc: %s: %w", name, err)
			}
			pruneDirs(st, g.prefix)
		}
		res.Unfinished = append(res.Unfinished, name)
		res.Objects += len(names)
		res.Bytes += g.bytes
	}
	switch s := st.(type) {
	case *s3.Store:
		if !cfg.dryRun {
			if res.Uploads, err = s.RemoveIncomplete(ctx, "", age); err != nil {
				return fmt.Errorf("gc: %w", err)
			}
		}
	case *dir.Store:
		if res.TempFiles, err = removeTempFiles(s.String(), cutoff, cfg.dryRun); err != nil {
			return fmt.Errorf("gc: %w", err)
		}
	}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(res)
	}
	verb := "removed"
	if cfg.dryRun {
		verb = "would remove"
	}
	for _, n := range res.Unfinished {
		fmt.Fprintf(cfg.stdout, "%s unfinished checkpoint %s\n", verb, n)
	}
	fmt.Fprintf(cfg.stdout, "gc %s: %s %d unfinished checkpoint(s) (%d objects, %s)", res.Location, verb, len(res.Unfinished), res.Objects, humanBytes(res.Bytes))
	if _, ok := st.(*s3.Store); ok && !cfg.dryRun {
		fmt.Fprintf(cfg.stdout, ", aborted %d incomplete upload(s)", res.Uploads)
	}
	if _, ok := st.(*dir.Store); ok {
		fmt.Fprintf(cfg.stdout, ", %d temporary file(s)", res.TempFiles)
	}
	fmt.Fprintln(cfg.stdout)
	return nil
}

// tempRE matches what sinks.Dir writes before a commit renames it.
var tempRE = regexp.MustCompile(`^\..+\.tmp-[0-9]+$`)

// removeTempFiles removes the temporary files of writers that died before
// they committed.
func removeTempFiles(root string, cutoff time.Time, dryRun bool) (int, error) {
	n := 0
	err := filepath.WalkDir(root, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if e.IsDir() || !tempRE.MatchString(path.Base(filepath.ToSlash(p))) {
			return nil
		}
		info, err := e.Info()
		if err != nil || info.ModTime().After(cutoff) {
			return nil
		}
		if !dryRun {
			if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return err
			}
		}
		n++
		return nil
	})
	return n, err
}
