package chunkstore

// Locks keep gc from deleting a pack that a capture in flight may still
// reference (restic's model: shared locks for backups, an exclusive one for
// prune). Each taker creates its own lock object, then lists the others:
// of two takers that race, at least one sees the other's lock, because each
// lists after its own is visible. A capture that sees a gc lock loads no
// index (it then references only packs it writes itself, which gc's listing
// predates); a gc that sees any other live lock deletes nothing. A lock
// whose object is older than StaleLock is ignored: its taker died.

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/store"
)

// Lock kinds. A check lock is shared, as a capture's: it keeps gc away
// while check reads; check --repair-index takes a gc lock, exclusive.
const (
	LockCapture = "capture"
	LockCheck   = "check"
	LockGC      = "gc"
)

// StaleLock is the age after which a lock no longer counts: longer than any
// capture or gc runs.
var StaleLock = 6 * time.Hour

// Lock is a held lock object.
type Lock struct {
	st   store.Store
	name string
	// Others are the live locks of other takers seen when it was taken,
	// by kind.
	Others map[string][]string
}

// TakeLock creates a lock of kind in the location st and lists the live
// locks of others.
func TakeLock(ctx context.Context, st store.Store, kind string) (*Lock, error) {
	id := NewPackID()
	name := LockPrefix + kind + "-" + hex.EncodeToString(id[:])
	host, _ := os.Hostname()
	body, _ := json.Marshal(map[string]any{"kind": kind, "host": host, "pid": os.Getpid(), "created": time.Now().UTC()})
	// A gc at age 0 removes a directory's temporary files, the lock's
	// among them before it is committed: try again.
	var err error
	for range 3 {
		if err = putNew(ctx, st, name, body); !errors.Is(err, fs.ErrNotExist) {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("take %s lock: %w", kind, err)
	}
	l := &Lock{st: st, name: name, Others: map[string][]string{}}
	objs, err := st.List(ctx, LockPrefix)
	if err != nil {
		l.Release(ctx)
		return nil, fmt.Errorf("list locks of %s: %w", st, err)
	}
	for _, o := range objs {
		if o.Name == name || time.Since(o.Modified) > StaleLock {
			continue
		}
		k, _, ok := strings.Cut(strings.TrimPrefix(o.Name, LockPrefix), "-")
		if ok {
			l.Others[k] = append(l.Others[k], o.Name)
		}
	}
	return l, nil
}

// Release deletes the lock object, also when ctx has ended.
func (l *Lock) Release(ctx context.Context) {
	if l == nil {
		return
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	_ = l.st.Delete(rctx, l.name)
}

// Held are the live locks of others seen when l was taken, of any kind,
// sorted.
func (l *Lock) Held() []string {
	var out []string
	for _, names := range l.Others {
		out = append(out, names...)
	}
	slices.Sort(out)
	return out
}
