package streamer

// The commit is the proof: a checkpoint's manifest is written only once
// the capture's lock is known to have stayed fresh all along (so no gc
// took the capture for dead, and none will until the lock is released),
// and every object the manifest names is there, at its size, at that
// moment. Whatever removed one meanwhile (a gc run while the lock had
// lapsed, a hand), the capture fails, and CRIU, waiting on the commit,
// resumes the process; it never exits 0 with a checkpoint that cannot be
// read.

import (
	"context"
	"fmt"
	"strings"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store"
)

// prove confirms lock (nil: none) and checks that st holds every segment
// of segs at its size; listPrefix is as store.Missing takes it.
func prove(ctx context.Context, lock *store.Lock, st store.Store, segs []manifest.Segment, listPrefix string) error {
	if err := lock.Confirm(ctx); err != nil {
		return fmt.Errorf("refusing to commit: %w", err)
	}
	want := make([]store.ObjectInfo, len(segs))
	for i, s := range segs {
		want[i] = store.ObjectInfo{Name: s.Name, Size: s.Size}
	}
	missing, err := store.Missing(ctx, st, want, listPrefix)
	if err != nil {
		return fmt.Errorf("refusing to commit: check the objects the manifest names: %w", err)
	}
	if len(missing) == 0 {
		return nil
	}
	shown := missing[:min(len(missing), 3)]
	more := ""
	if len(missing) > len(shown) {
		more = fmt.Sprintf(" and %d more", len(missing)-len(shown))
	}
	return fmt.Errorf("refusing to commit: %d of the %d objects the manifest names are not in %s as written (%s%s); something removed them meanwhile: %w",
		len(missing), len(segs), st, strings.Join(shown, ", "), more, errdefs.ErrNotFound)
}
