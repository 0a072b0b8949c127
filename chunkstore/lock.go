package chunkstore

// Locks keep gc from deleting a pack that a capture in flight may still
// reference (restic's model: shared locks for backups, an exclusive one for
// prune). Each taker creates its own lock object (store.Lock, refreshed
// while it runs), then lists the others: of two takers that race, at least
// one sees the other's lock, because each lists after its own is visible.
// A capture (Writer) that sees a gc lock loads no index (it references only
// packs it writes itself, which gc's listing predates); a gc that sees any
// other live lock deletes nothing. A lock older than store.StaleLock, by
// the store's clock (against the taker's own lock, just written), or whose
// holder is known gone (store.HolderGone), is ignored: its taker died.

import (
	"context"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/store"
)

// Lock kinds. A check lock is shared, as a capture's: it keeps gc away
// while check reads; check --repair-index takes a gc lock, exclusive.
const (
	LockCapture = "capture"
	LockGC      = "gc"
	LockCheck   = "check"
)

// Lock is a held lock object of a chunk store.
type Lock struct {
	*store.Lock
	// Others are the live locks of other takers seen when it was taken,
	// by kind.
	Others map[string][]string
	// Stale are the locks seen that count no longer: stale, or their
	// holder gone.
	Stale []string
	// Now is the store's clock when it was taken: its own object's time
	// in the listing of the locks.
	Now time.Time
}

// TakeLock creates a lock of kind in the location st and lists the live
// locks of others.
func TakeLock(ctx context.Context, st store.Store, kind string) (*Lock, error) {
	id := NewPackID()
	name := LockPrefix + kind + "-" + hex.EncodeToString(id[:])
	held, err := store.TakeLock(ctx, st, name, kind)
	if err != nil {
		return nil, err
	}
	l := &Lock{Lock: held, Others: map[string][]string{}}
	objs, err := st.List(ctx, LockPrefix)
	if err != nil {
		l.Release(ctx)
		return nil, fmt.Errorf("list locks of %s: %w", st, err)
	}
	for _, o := range objs {
		if o.Name == name {
			l.Now = o.Modified
		}
	}
	if l.Now.IsZero() {
		l.Release(ctx)
		return nil, fmt.Errorf("list locks of %s: the lock %s just written is not listed", st, name)
	}
	for _, o := range objs {
		if o.Name == name {
			continue
		}
		k, _, ok := strings.Cut(strings.TrimPrefix(o.Name, LockPrefix), "-")
		switch {
		case !ok:
		case !store.Fresh(o, l.Now) || store.HolderGoneAt(ctx, st, o.Name):
			l.Stale = append(l.Stale, o.Name)
		default:
			l.Others[k] = append(l.Others[k], o.Name)
		}
	}
	return l, nil
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
