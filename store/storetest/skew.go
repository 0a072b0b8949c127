package storetest

import (
	"context"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/store"
)

// Skewed is a store whose clock reads off the local one: each object's
// time, as List and Stat give it, is its real one moved by the offset set
// when it was committed (Skew, Advance), and Backdate sets one object's
// time back, as `touch -d` does, until it is written again. It stands for
// a store whose clock differs from the hosts' (a capture on a host 2 hours
// behind), for time passing on the store (Advance: objects written from
// then on are that much later), and for a lock left unrefreshed. It counts
// the commits of each name, so that a test can wait for a refresh.
type Skewed struct {
	store.Store

	mu      sync.Mutex
	offset  time.Duration            // for objects committed from now on
	shift   map[string]time.Duration // per committed object
	commits map[string]int
	changed chan struct{} // closed and replaced at every commit
}

// Skew wraps s, its clock off the real one by offset.
func Skew(s store.Store, offset time.Duration) *Skewed {
	return &Skewed{Store: s, offset: offset, shift: map[string]time.Duration{}, commits: map[string]int{}, changed: make(chan struct{})}
}

// Advance moves the store's clock on by d for the objects committed from
// now on.
func (s *Skewed) Advance(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.offset += d
}

// Now is the store's clock.
func (s *Skewed) Now() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return time.Now().Add(s.offset)
}

// Backdate sets the time of the object name back by d, until it is
// committed again.
func (s *Skewed) Backdate(name string, d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sh, ok := s.shift[name]
	if !ok {
		sh = s.offset
	}
	s.shift[name] = sh - d
}

// Commits is how many times name was committed through s, and a channel
// closed at the next commit of any object.
func (s *Skewed) Commits(name string) (int, <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.commits[name], s.changed
}

// WaitCommit waits until name has been committed more than n times, or ctx
// ends (false).
func (s *Skewed) WaitCommit(ctx context.Context, name string, n int) bool {
	for {
		got, changed := s.Commits(name)
		if got > n {
			return true
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return false
		}
	}
}

func (s *Skewed) moved(o store.ObjectInfo, name string) store.ObjectInfo {
	s.mu.Lock()
	defer s.mu.Unlock()
	sh, ok := s.shift[name]
	if !ok {
		sh = s.offset
	}
	o.Modified = o.Modified.Add(sh)
	return o
}

// Stat implements store.Store.
func (s *Skewed) Stat(ctx context.Context, name string) (store.ObjectInfo, error) {
	o, err := s.Store.Stat(ctx, name)
	if err != nil {
		return o, err
	}
	return s.moved(o, name), nil
}

// List implements store.Store.
func (s *Skewed) List(ctx context.Context, prefix string) ([]store.ObjectInfo, error) {
	objs, err := s.Store.List(ctx, prefix)
	for i := range objs {
		objs[i] = s.moved(objs[i], objs[i].Name)
	}
	return objs, err
}

// Delete implements store.Store.
func (s *Skewed) Delete(ctx context.Context, name string) error {
	err := s.Store.Delete(ctx, name)
	if err == nil {
		s.mu.Lock()
		delete(s.shift, name)
		s.mu.Unlock()
	}
	return err
}

// Create implements store.Store.
func (s *Skewed) Create(ctx context.Context, name string) (store.ObjectWriter, error) {
	w, err := s.Store.Create(ctx, name)
	if err != nil {
		return nil, err
	}
	return &skewedWriter{ObjectWriter: w, s: s, name: name}, nil
}

type skewedWriter struct {
	store.ObjectWriter
	s    *Skewed
	name string
}

func (w *skewedWriter) Commit(ctx context.Context) error {
	return w.committed(w.ObjectWriter.Commit(ctx))
}

func (w *skewedWriter) CommitNew(ctx context.Context) error {
	return w.committed(w.ObjectWriter.CommitNew(ctx))
}

func (w *skewedWriter) committed(err error) error {
	if err != nil {
		return err
	}
	s := w.s
	s.mu.Lock()
	defer s.mu.Unlock()
	s.shift[w.name] = s.offset
	s.commits[w.name]++
	close(s.changed)
	s.changed = make(chan struct{})
	return nil
}
