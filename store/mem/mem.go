// Package mem is a store.Store in memory, for tests of the rooms above it
// and for benchmarks that must not measure a disk. Objects appear on Commit,
// as the Store contract asks; FailWrite and FailCommit inject faults.
package mem

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/store"
)

// Store keeps committed objects in a map.
type Store struct {
	name string

	mu   sync.Mutex
	objs map[string][]byte
	// mtime is when each object was committed: the store's clock, which
	// locks and gc judge ages by.
	mtime map[string]time.Time
	// FailWrite, when set, is asked before every Write to an object with
	// the bytes written to it so far.
	FailWrite func(name string, written int64) error
	// FailCommit, when set, is asked before an object is committed.
	FailCommit func(name string) error
}

// New returns an empty store that names itself mem://name.
func New(name string) *Store {
	return &Store{name: name, objs: map[string][]byte{}, mtime: map[string]time.Time{}}
}

func (s *Store) String() string { return "mem://" + s.name }

type writer struct {
	s    *Store
	name string
	buf  bytes.Buffer
	done bool
}

// Create starts an object.
func (s *Store) Create(ctx context.Context, name string) (store.ObjectWriter, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := store.CheckName(name); err != nil {
		return nil, fmt.Errorf("%s: %w", s, err)
	}
	return &writer{s: s, name: name}, nil
}

func (w *writer) Write(p []byte) (int, error) {
	w.s.mu.Lock()
	fw, done := w.s.FailWrite, w.done
	w.s.mu.Unlock()
	if done {
		return 0, fmt.Errorf("write to finished object %s", w.name)
	}
	if fw != nil {
		if err := fw(w.name, int64(w.buf.Len())); err != nil {
			return 0, err
		}
	}
	return w.buf.Write(p)
}

func (w *writer) Commit(ctx context.Context) error { return w.commit(ctx, false) }

// CommitNew decides under the store's lock, which makes it atomic.
func (w *writer) CommitNew(ctx context.Context) error { return w.commit(ctx, true) }

func (w *writer) commit(ctx context.Context, exclusive bool) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("commit %s: %w", w.name, err)
	}
	w.s.mu.Lock()
	defer w.s.mu.Unlock()
	if w.done {
		return fmt.Errorf("commit of finished object %s", w.name)
	}
	if w.s.FailCommit != nil {
		if err := w.s.FailCommit(w.name); err != nil {
			return err
		}
	}
	w.done = true
	if _, ok := w.s.objs[w.name]; ok && exclusive {
		w.buf = bytes.Buffer{}
		return fmt.Errorf("commit %s/%s: %w", w.s, w.name, errdefs.ErrExists)
	}
	w.s.objs[w.name] = bytes.Clone(w.buf.Bytes())
	w.s.mtime[w.name] = time.Now()
	return nil
}

func (w *writer) Abort(ctx context.Context) error {
	w.s.mu.Lock()
	defer w.s.mu.Unlock()
	w.done = true
	return nil
}

// Open reads [off, off+length) of an object (length < 0: to the end).
func (s *Store) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	b, ok := s.objs[name]
	s.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("%s/%s: %w", s, name, errdefs.ErrNotFound)
	}
	if off < 0 {
		return nil, fmt.Errorf("%s/%s: negative offset %d", s, name, off)
	}
	off = min(off, int64(len(b)))
	end := int64(len(b))
	if length >= 0 && off+length < end {
		end = off + length
	}
	return io.NopCloser(bytes.NewReader(b[off:end])), nil
}

// Stat returns an object's size.
func (s *Store) Stat(ctx context.Context, name string) (store.ObjectInfo, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.objs[name]
	if !ok {
		return store.ObjectInfo{}, fmt.Errorf("%s/%s: %w", s, name, errdefs.ErrNotFound)
	}
	return store.ObjectInfo{Name: name, Size: int64(len(b)), Modified: s.mtime[name]}, nil
}

// List returns the objects whose names start with prefix, sorted.
func (s *Store) List(ctx context.Context, prefix string) ([]store.ObjectInfo, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []store.ObjectInfo
	for n, b := range s.objs {
		if strings.HasPrefix(n, prefix) {
			out = append(out, store.ObjectInfo{Name: n, Size: int64(len(b)), Modified: s.mtime[n]})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// Delete removes an object; a missing one is no error.
func (s *Store) Delete(ctx context.Context, name string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.objs, name)
	delete(s.mtime, name)
	return nil
}

// Object returns a committed object's bytes (not a copy), nil if absent.
func (s *Store) Object(name string) []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.objs[name]
}

// Put replaces an object's bytes at once, as a test that damages an
// archive does.
func (s *Store) Put(name string, b []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.objs[name] = b
	s.mtime[name] = time.Now()
}

// Names lists the committed objects, sorted.
func (s *Store) Names() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.objs))
	for n := range s.objs {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}
