package dir

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/store"
)

// A writer's temporary file is ".NAME" + tempInfix + a random number, next
// to NAME; Commit renames it to NAME, so only a writer that died leaves
// one behind.
const tempInfix = ".tmp-"

var tempRE = regexp.MustCompile(`^\.(.+)` + regexp.QuoteMeta(tempInfix) + `[0-9]+$`)

// RemoveTemp removes what writers that died left below the root, last
// modified before cutoff, and only what ours recognises: the temporary
// files of objects ours names, and the directories that hold nothing
// else, where ours names the directory (a failed checkpoint's empty
// segments/) or this sweep emptied it. ours is asked about object names,
// and about directories as a name with a "/" at its end; whatever it does
// not recognise is left alone (a user's own empty directories, files
// that only look temporary). With dryRun it removes nothing. It returns
// what it removed (or would), named relative to the root, directories
// with a "/" at the end.
func (d *Store) RemoveTemp(ctx context.Context, cutoff time.Time, dryRun bool, ours func(name string) bool) ([]string, error) {
	var removed []string
	gone := map[string]bool{}    // paths removed, or that would be in a dry run
	emptied := map[string]bool{} // directories something was removed from
	var dirs []string            // old enough, as found before anything was removed
	err := filepath.WalkDir(d.root, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			// No root (nothing written yet), or a directory removed as
			// the walk came to it (an rm meanwhile): nothing to sweep.
			if errors.Is(err, fs.ErrNotExist) {
				return filepath.SkipDir
			}
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if e.IsDir() && p != d.root {
			if info, err := e.Info(); err == nil && !info.ModTime().After(cutoff) {
				dirs = append(dirs, p)
			}
		}
		m := tempRE.FindStringSubmatch(e.Name())
		if !e.Type().IsRegular() || m == nil || !ours(d.rel(filepath.Join(filepath.Dir(p), m[1]))) {
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
		gone[p], emptied[filepath.Dir(p)] = true, true
		removed = append(removed, d.rel(p))
		return nil
	})
	if err != nil {
		return removed, err
	}
	// Deepest first, so that a directory emptied by its children's removal
	// goes too; Remove fails on one that is not empty.
	for i := len(dirs) - 1; i >= 0; i-- {
		entries, err := os.ReadDir(dirs[i])
		if err != nil {
			continue
		}
		empty := true
		for _, e := range entries {
			empty = empty && gone[filepath.Join(dirs[i], e.Name())]
		}
		name := d.rel(dirs[i]) + "/"
		if empty && (ours(name) || emptied[dirs[i]]) && (dryRun || os.Remove(dirs[i]) == nil) {
			gone[dirs[i]], emptied[filepath.Dir(dirs[i])] = true, true
			removed = append(removed, name)
		}
	}
	return removed, nil
}

// rel is path p below the root as an object name.
func (d *Store) rel(p string) string {
	r, err := filepath.Rel(d.root, p)
	if err != nil {
		return p
	}
	return filepath.ToSlash(r)
}

// RemoveEmptyDirs removes the directories of the given object-name
// prefixes ("" is the root), in order, where they are empty: what removed
// objects leave behind.
func (d *Store) RemoveEmptyDirs(prefixes ...string) {
	for _, p := range prefixes {
		switch {
		case p == "":
			os.Remove(d.root) // only if empty
		case store.CheckName(p) == nil:
			d.removeDir(strings.Split(strings.TrimSuffix(p, "/"), "/"))
		}
	}
}
