package container

// A Podman container's root file system changes, as podman's own export
// writes them (podman's pkg/checkpoint/crutils, CRCreateRootFsDiffTar):
// rootfs-diff.tar holds what was added (and here what was changed too,
// which podman's leaves out), relative to the root; deleted.files is a
// JSON list of the paths removed. `podman diff` names them; its answer
// comes while the container is frozen (it takes no container lock).

import (
	"archive/tar"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// podmanDiff is `podman diff --format json`.
type podmanDiff struct {
	Changed []string `json:"changed"`
	Added   []string `json:"added"`
	Deleted []string `json:"deleted"`
}

// writeRootfsDiff writes rootfs-diff.tar and deleted.files of container
// id, whose root file system is mounted at root, into dir.
func writeRootfsDiff(ctx context.Context, bin, id, root, dir string) error {
	out, _, err := command(ctx, "", bin, "diff", "--format", "json", id)
	if err != nil {
		return fmt.Errorf("root file system changes: %w", err)
	}
	var d podmanDiff
	if err := json.Unmarshal([]byte(out), &d); err != nil {
		return fmt.Errorf("podman diff %s: %w", id, err)
	}
	deleted := d.Deleted
	if deleted == nil {
		deleted = []string{}
	}
	b, err := json.Marshal(deleted)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, deletedFiles), b, 0o600); err != nil {
		return err
	}
	f, err := os.OpenFile(filepath.Join(dir, rootfsDiff), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	seen := map[string]bool{}
	for _, list := range []struct {
		paths []string
		dirs  bool // a directory's contents too
	}{{d.Added, true}, {d.Changed, false}} {
		for _, p := range list.paths {
			if err := addTree(tw, root, p, list.dirs, seen); err != nil {
				return fmt.Errorf("root file system changes: %s: %w", p, err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return f.Close()
}

// addTree adds path (absolute in the container) under root to tw: a file
// or link; a directory with what is in it if all, else not at all (a
// changed directory: what changed in it is listed itself).
func addTree(tw *tar.Writer, root, path string, all bool, seen map[string]bool) error {
	rel := strings.TrimPrefix(filepath.Clean("/"+path), "/")
	if rel == "" {
		return nil
	}
	top := filepath.Join(root, rel)
	st, err := os.Lstat(top)
	if errors.Is(err, fs.ErrNotExist) || (err == nil && st.IsDir() && !all) {
		return nil // nothing there to carry, or a changed directory
	}
	if err != nil {
		return err
	}
	return filepath.WalkDir(top, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name, _ := filepath.Rel(root, p)
		if seen[name] {
			return nil
		}
		seen[name] = true
		return addEntry(tw, p, name)
	})
}

func addEntry(tw *tar.Writer, p, name string) error {
	st, err := os.Lstat(p)
	if err != nil {
		return err
	}
	link := ""
	if st.Mode()&fs.ModeSymlink != 0 {
		if link, err = os.Readlink(p); err != nil {
			return err
		}
	}
	h, err := tar.FileInfoHeader(st, link)
	if err != nil {
		return err
	}
	h.Name = name
	if st.IsDir() {
		h.Name += "/"
	}
	if err := tw.WriteHeader(h); err != nil {
		return err
	}
	if !st.Mode().IsRegular() {
		return nil
	}
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = io.CopyN(tw, f, st.Size())
	return err
}
