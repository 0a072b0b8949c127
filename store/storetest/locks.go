package storetest

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/store"
)

// testModified: an object's time is when it was last committed, by the
// store's clock, as locks and gc rely on (store.Lock): it stays while
// other objects are committed, and committing it again moves it on, past
// theirs; List and Stat agree (to the second: a HEAD's Last-Modified has
// no more).
func testModified(t *testing.T, s store.Store) {
	ctx := ctxT(t)
	put(t, s, "obj", []byte("one"))
	first, err := s.Stat(ctx, "obj")
	if err != nil {
		t.Fatal(err)
	}
	// Wait for the store's clock to move on, by objects it dates.
	var between store.ObjectInfo
	for i := 0; !between.Modified.After(first.Modified.Add(time.Second)); i++ {
		if err := ctx.Err(); err != nil {
			t.Fatalf("the store's clock never passed %v: %v", first.Modified, err)
		}
		put(t, s, "probe", []byte{byte(i)})
		if between, err = s.Stat(ctx, "probe"); err != nil {
			t.Fatal(err)
		}
	}
	if still, err := s.Stat(ctx, "obj"); err != nil || still.Modified.After(first.Modified.Add(time.Second)) {
		t.Errorf("obj, not committed again, dates from %v, not %v: %v", still.Modified, first.Modified, err)
	}
	put(t, s, "obj", []byte("two"))
	again, err := s.Stat(ctx, "obj")
	if err != nil {
		t.Fatal(err)
	}
	if again.Modified.Before(between.Modified) {
		t.Errorf("obj committed again dates from %v, before %v of an object committed in between (first %v)", again.Modified, between.Modified, first.Modified)
	}
	list, err := s.List(ctx, "obj")
	if err != nil || len(list) != 1 {
		t.Fatalf("List: %v, %v", list, err)
	}
	if d := list[0].Modified.Sub(again.Modified); d > time.Second || d < -time.Second {
		t.Errorf("List dates obj %v, Stat %v", list[0].Modified, again.Modified)
	}
}

// testLock: a lock is kept fresh while its holder runs, across hours of
// the store's clock (Skewed.Advance), by the store's clock alone; a lock
// set back past store.StaleLock, or removed, is a lapse its holder learns
// of (a holder frozen that long: store's lock_test.go, which injects the
// holder's clock); Release stops the refreshing and removes it.
func testLock(t *testing.T, s store.Store) {
	ctx := ctxT(t)
	defer func(every time.Duration) { store.LockRefresh = every }(store.LockRefresh)
	store.LockRefresh = 5 * time.Millisecond
	const name = "locks/capture-1"

	t.Run("fresh", func(t *testing.T) {
		// Seven hours of the store's clock, an hour at a time, each
		// followed by a refresh: always fresh, no lapse.
		sk := Skew(s, -2*time.Hour) // the store 2 hours behind the hosts
		l, err := store.TakeLock(ctx, sk, name, "capture")
		if err != nil {
			t.Fatal(err)
		}
		for range 7 {
			sk.Advance(time.Hour)
			n, _ := sk.Commits(name)
			if !sk.WaitCommit(ctx, name, n) {
				t.Fatal("no refresh")
			}
			info, err := sk.Stat(ctx, name)
			if err != nil || !store.Fresh(info, sk.Now()) {
				t.Fatalf("lock after a refresh: %+v, %v; fresh at %v: no", info, err, sk.Now())
			}
		}
		if err := l.Confirm(ctx); err != nil {
			t.Fatalf("Confirm: %v", err)
		}
		// Refreshing has stopped, and the lock is as the last refresh
		// left it: Confirm only looks.
		n, _ := sk.Commits(name)
		if err := l.Confirm(ctx); err != nil {
			t.Fatalf("Confirm again: %v", err)
		}
		if m, _ := sk.Commits(name); m != n {
			t.Errorf("Confirm of an unchanged lock rewrote it")
		}
		l.Release(ctx)
		n, _ = sk.Commits(name)
		mustNotExist(t, s, name, "after Release")
		if m, _ := sk.Commits(name); m != n {
			t.Errorf("refreshed %d times after Release", m-n)
		}
	})
	lapses := []struct {
		name  string
		lapse func(sk *Skewed)
		why   string
	}{
		{"backdated", func(sk *Skewed) { sk.Backdate(name, store.StaleLock+time.Hour) }, "went unrefreshed"},
		{"removed", func(sk *Skewed) { _ = sk.Delete(context.Background(), name) }, "was removed"},
	}
	for _, tc := range lapses {
		t.Run(tc.name, func(t *testing.T) {
			// No refresh but Confirm's: it measures the lapse alone.
			store.LockRefresh = time.Hour
			defer func() { store.LockRefresh = 5 * time.Millisecond }()
			sk := Skew(s, 0)
			l, err := store.TakeLock(ctx, sk, name, "capture")
			if err != nil {
				t.Fatal(err)
			}
			defer l.Release(ctx)
			tc.lapse(sk)
			if err := l.Confirm(ctx); !errors.Is(err, store.ErrLockLapsed) || !strings.Contains(err.Error(), tc.why) {
				t.Errorf("Confirm after the lock %s: %v", tc.name, err)
			}
			if err := l.Lapsed(); !errors.Is(err, store.ErrLockLapsed) {
				t.Errorf("Lapsed after the lock %s: %v", tc.name, err)
			}
			l.Release(ctx)
			mustNotExist(t, s, name, "after Release")
		})
	}
	t.Run("taken", func(t *testing.T) {
		l, err := store.TakeLock(ctx, s, name, "capture")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Release(ctx)
		if _, err := store.TakeLock(ctx, s, name, "capture"); !errors.Is(err, errdefs.ErrExists) {
			t.Errorf("a second TakeLock of one name: %v, want ErrExists", err)
		}
	})
}
