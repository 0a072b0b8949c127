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

var tempRE = regexp.MustCompile(`^\..+` + regexp.QuoteMeta(tempInfix) + `[0-9]+$`)

// RemoveTemp removes the temporary files of writers that died before they
// committed, and the directories below the root that are empty (what
// failed or interrupted checkpoints left, a segments/ of nothing), last
// modified before cutoff; with dryRun it only counts them.
func (d *Store) RemoveTemp(ctx context.Context, cutoff time.Time, dryRun bool) (int, error) {
	n := 0
	var dirs []string // old enough, as found before anything was removed
	err := filepath.WalkDir(d.root, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
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
		if e.IsDir() || !tempRE.MatchString(e.Name()) {
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
	if err != nil {
		return n, err
	}
	// Deepest first, so that a directory emptied by its children's removal
	// goes too; Remove fails on one that is not empty.
	gone := map[string]bool{} // removed, or would be in a dry run
	for i := len(dirs) - 1; i >= 0; i-- {
		entries, err := os.ReadDir(dirs[i])
		if err != nil {
			continue
		}
		empty := true
		for _, e := range entries {
			empty = empty && gone[filepath.Join(dirs[i], e.Name())]
		}
		if empty && (dryRun || os.Remove(dirs[i]) == nil) {
			gone[dirs[i]] = true
			n++
		}
	}
	return n, nil
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
