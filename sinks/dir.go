// Package sinks holds the places checkpoints go to and come from: standard
// streams, local archive directories, and (behind the same Store interface)
// object stores. Every Store passes the suite in sinks/storetest.
package sinks

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/streamer"
)

// Dir is a Store in a local directory. Objects are written to a temporary
// name and renamed on commit, after fsync, so a crash never leaves a
// half-written object under its real name.
type Dir struct {
	root string
}

// NewDir returns a Store rooted at root; the directory is created on the
// first write.
func NewDir(root string) *Dir { return &Dir{root: filepath.Clean(root)} }

// String implements streamer.Store.
func (d *Dir) String() string { return d.root }

func (d *Dir) path(name string) (string, error) {
	if name == "" || strings.Contains(name, "..") || strings.HasPrefix(name, "/") || strings.ContainsRune(name, 0) {
		return "", fmt.Errorf("%s: invalid object name %q", d.root, name)
	}
	return filepath.Join(d.root, filepath.FromSlash(name)), nil
}

type dirWriter struct {
	f     *os.File
	final string
	n     int64
	done  bool
}

// Create implements streamer.Store.
func (d *Dir) Create(ctx context.Context, name string) (streamer.ObjectWriter, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	p, err := d.path(name)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return nil, fmt.Errorf("create %s: %w", p, err)
	}
	f, err := os.CreateTemp(filepath.Dir(p), "."+filepath.Base(p)+".tmp-*")
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", p, err)
	}
	return &dirWriter{f: f, final: p}, nil
}

func (w *dirWriter) Write(b []byte) (int, error) {
	n, err := w.f.Write(b)
	w.n += int64(n)
	return n, err
}

func (w *dirWriter) Commit(ctx context.Context) error {
	if w.done {
		return errors.New("commit: object already finished")
	}
	w.done = true
	fail := func(err error) error {
		w.f.Close()
		os.Remove(w.f.Name())
		return fmt.Errorf("commit %s: %w", w.final, err)
	}
	if err := ctx.Err(); err != nil {
		return fail(err)
	}
	st, err := w.f.Stat()
	if err != nil {
		return fail(err)
	}
	if st.Size() != w.n {
		return fail(fmt.Errorf("wrote %d bytes but the file holds %d", w.n, st.Size()))
	}
	if err := w.f.Sync(); err != nil {
		return fail(err)
	}
	if err := w.f.Close(); err != nil {
		return fail(err)
	}
	if err := os.Rename(w.f.Name(), w.final); err != nil {
		return fail(err)
	}
	return syncDir(filepath.Dir(w.final))
}

func (w *dirWriter) Abort(ctx context.Context) error {
	if w.done {
		return nil
	}
	w.done = true
	w.f.Close()
	return os.Remove(w.f.Name())
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Sync(); err != nil && !errors.Is(err, os.ErrInvalid) {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}

type sectionReader struct {
	io.Reader
	f *os.File
}

func (s sectionReader) Close() error { return s.f.Close() }

// Open implements streamer.Store.
func (d *Dir) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	p, err := d.path(name)
	if err != nil {
		return nil, err
	}
	f, err := os.Open(p)
	if err != nil {
		return nil, wrapNotExist(err)
	}
	if length < 0 {
		st, err := f.Stat()
		if err != nil {
			f.Close()
			return nil, err
		}
		length = st.Size() - off
	}
	return sectionReader{Reader: io.NewSectionReader(f, off, length), f: f}, nil
}

func wrapNotExist(err error) error {
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w: %w", errdefs.ErrNotFound, err)
	}
	return err
}

// Stat implements streamer.Store.
func (d *Dir) Stat(ctx context.Context, name string) (streamer.ObjectInfo, error) {
	if err := ctx.Err(); err != nil {
		return streamer.ObjectInfo{}, err
	}
	p, err := d.path(name)
	if err != nil {
		return streamer.ObjectInfo{}, err
	}
	st, err := os.Stat(p)
	if err != nil {
		return streamer.ObjectInfo{}, wrapNotExist(err)
	}
	if st.IsDir() {
		return streamer.ObjectInfo{}, fmt.Errorf("%s is a directory: %w", p, errdefs.ErrNotFound)
	}
	return streamer.ObjectInfo{Name: name, Size: st.Size(), Modified: st.ModTime()}, nil
}

// List implements streamer.Store. Temporary files of unfinished writes are
// not objects and are not listed.
func (d *Dir) List(ctx context.Context, prefix string) ([]streamer.ObjectInfo, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	var out []streamer.ObjectInfo
	err := filepath.WalkDir(d.root, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) && p == d.root {
				return filepath.SkipDir
			}
			return err
		}
		if e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			return nil
		}
		rel, err := filepath.Rel(d.root, p)
		if err != nil {
			return err
		}
		name := filepath.ToSlash(rel)
		if !strings.HasPrefix(name, prefix) {
			return nil
		}
		info, err := e.Info()
		if err != nil {
			return err
		}
		out = append(out, streamer.ObjectInfo{Name: name, Size: info.Size(), Modified: info.ModTime()})
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", d.root, err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// Delete implements streamer.Store.
func (d *Dir) Delete(ctx context.Context, name string) error {
	p, err := d.path(name)
	if err != nil {
		return err
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("delete %s: %w", p, err)
	}
	return nil
}
