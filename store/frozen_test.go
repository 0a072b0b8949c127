package store_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/store/storetest"
)

// TestFrozenHolder: a holder frozen (or its host asleep) for StaleLock,
// its lock untouched meanwhile, finds at Confirm that it lapsed: by its
// own clock it was away too long, so it refreshes, and the store's clock
// shows the gap. Away less long, Confirm only looks.
func TestFrozenHolder(t *testing.T) {
	defer func(every time.Duration) { store.LockRefresh = every }(store.LockRefresh)
	store.LockRefresh = time.Hour // no refresh but Confirm's
	for kind, st := range map[string]store.Store{"mem": mem.New("frozen"), "dir": dir.New(t.TempDir())} {
		for _, away := range []time.Duration{time.Hour, store.StaleLock} {
			t.Run(kind+"/"+away.String(), func(t *testing.T) {
				ctx := context.Background()
				sk := storetest.Skew(st, 0)
				l, err := store.TakeLock(ctx, sk, "locks/capture-1", "capture")
				if err != nil {
					t.Fatal(err)
				}
				defer l.Release(ctx)
				var clock atomic.Int64
				store.SetClock(l, func() time.Duration { return time.Duration(clock.Load()) })
				// Its clock and the store's move on together.
				clock.Add(int64(away))
				sk.Advance(away)
				err = l.Confirm(ctx)
				if away < store.StaleLock/4 {
					if err != nil {
						t.Fatalf("Confirm after %v away: %v", away, err)
					}
					return
				}
				if !errors.Is(err, store.ErrLockLapsed) || !strings.Contains(err.Error(), "went unrefreshed") {
					t.Fatalf("Confirm after %v away: %v, want a lapse", away, err)
				}
			})
		}
	}
}
