package store

// Locks tell gc that a writer (a capture, a cp, a gc) lives. A lock is a
// small object its holder keeps fresh, rewriting it every LockRefresh
// while it runs; others judge it by the store's own clock: a lock whose
// object is older than StaleLock, against an object written just now, is
// its holder's death. No host's clock enters: a capture on a host whose
// clock is hours off is judged like any other.
//
// A lock also names its holder (host, boot, PID namespace, PID): one
// whose holder is a process of this host that no longer exists counts no
// longer, however fresh (HolderGone), restic's rule, so that a capture
// that failed where it could not remove its lock does not hold gc off for
// StaleLock.
//
// A holder that was stopped (a frozen process, a store out of reach) may
// have looked dead meanwhile, and gc may then have taken what it wrote or
// references. Each refresh therefore compares the object's time before it
// with the time after: a gap near StaleLock, or a lock gone, is a lapse,
// and Confirm, which a commit calls last, reports it. Confirm rewrites
// nothing when the lock is as the last refresh left it, not long ago by a
// clock that runs on while the host sleeps: one request, not three, on a
// commit's path (the process is frozen then). gc deletes a lock it takes
// for dead before anything it guards, so a holder that slept unseen finds
// its lock gone.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/errdefs"
)

var (
	// StaleLock is the age, by the store's clock, after which a lock no
	// longer counts: its holder has not refreshed it for that long.
	StaleLock = 6 * time.Hour
	// LockRefresh is how often a holder rewrites its lock: well under
	// StaleLock, so that a holder stopped for a while still never looks
	// dead.
	LockRefresh = 10 * time.Minute
)

// ErrLockLapsed is a lock that looked stale, or went missing, while its
// holder ran: gc may have taken what the holder wrote.
var ErrLockLapsed = errors.New("lock lapsed")

// lockTimeout bounds each request of a refresh and of a release.
const lockTimeout = time.Minute

// Lock is a held lock object, refreshed by its own goroutine until Confirm
// or Release.
type Lock struct {
	st    Store
	name  string
	body  []byte
	stale time.Duration // StaleLock and LockRefresh as the lock was taken
	every time.Duration

	// clock runs on while the host is suspended (CLOCK_BOOTTIME); a
	// test injects its own.
	clock func() time.Duration

	mu     sync.Mutex
	lapse  error         // the first lapse seen
	last   time.Time     // the object's time after the last refresh
	lastAt time.Duration // clock() then

	stopOnce sync.Once
	stop     chan struct{}
	done     chan struct{}
	released bool
}

// holder is what a lock object says of its holder.
type holder struct {
	Kind    string    `json:"kind"`
	Host    string    `json:"host"`
	PID     int       `json:"pid"`
	Created time.Time `json:"created"` // the holder's clock: for people only
	Boot    string    `json:"boot,omitempty"`
	PIDNS   string    `json:"pid_ns,omitempty"`
}

// here is this process as a lock's holder.
var here = sync.OnceValue(func() holder {
	host, _ := os.Hostname()
	boot, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	ns, _ := os.Readlink("/proc/self/ns/pid")
	return holder{Host: host, PID: os.Getpid(), Boot: strings.TrimSpace(string(boot)), PIDNS: ns}
})

// HolderGone says body, a lock object's, names a holder that is a process
// of this host (this boot, this PID namespace) that no longer exists. A
// lock that does not say (written before 2026-12-05, or unreadable) is
// never taken for gone.
func HolderGone(body []byte) bool {
	var h holder
	if json.Unmarshal(body, &h) != nil || h.PID <= 0 || h.Boot == "" || h.PIDNS == "" {
		return false
	}
	me := here()
	if h.Host != me.Host || h.Boot != me.Boot || h.PIDNS != me.PIDNS || h.PID == me.PID {
		return false
	}
	return errors.Is(syscall.Kill(h.PID, 0), syscall.ESRCH)
}

// HolderGoneAt is HolderGone of the lock object name in st; a lock it
// cannot read is not gone.
func HolderGoneAt(ctx context.Context, st Store, name string) bool {
	r, err := st.Open(ctx, name, 0, maxLockBody)
	if err != nil {
		return false
	}
	defer r.Close()
	body, err := io.ReadAll(r)
	return err == nil && HolderGone(body)
}

// maxLockBody bounds what is read of a lock object: ours are under 300
// bytes.
const maxLockBody = 4 << 10

// TakeLock creates the lock object name of kind (capture, gc) in st,
// exclusively, and starts refreshing it.
func TakeLock(ctx context.Context, st Store, name, kind string) (*Lock, error) {
	h := here()
	h.Kind, h.Created = kind, time.Now().UTC()
	body, _ := json.Marshal(h)
	l := &Lock{st: st, name: name, body: body, stale: StaleLock, every: LockRefresh, clock: bootClock,
		stop: make(chan struct{}), done: make(chan struct{})}
	// A gc at age 0 may remove a directory's temporary files, the lock's
	// among them, before the lock is committed and counts: try again.
	var err error
	for range 3 {
		if err = l.put(ctx, true); !errors.Is(err, fs.ErrNotExist) {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("take %s lock %s/%s: %w", kind, st, name, err)
	}
	info, err := st.Stat(ctx, name)
	if err != nil {
		_ = st.Delete(context.WithoutCancel(ctx), name)
		return nil, fmt.Errorf("take %s lock %s/%s: %w", kind, st, name, err)
	}
	l.last, l.lastAt = info.Modified, l.clock()
	go l.beat()
	return l, nil
}

// Name is the lock's object name in its store.
func (l *Lock) Name() string { return l.name }

// Fresh says o, a lock object seen in a listing, counts at now (a time by
// the store's clock: of a lock written just before the listing).
func Fresh(o ObjectInfo, now time.Time) bool { return now.Sub(o.Modified) <= StaleLock }

// put writes the lock's object: exclusively when taken, over itself when
// refreshed.
func (l *Lock) put(ctx context.Context, exclusive bool) error {
	w, err := l.st.Create(ctx, l.name)
	if err != nil {
		return err
	}
	if _, err := w.Write(l.body); err != nil {
		_ = w.Abort(ctx)
		return err
	}
	if exclusive {
		err = w.CommitNew(ctx)
	} else {
		err = w.Commit(ctx)
	}
	if err != nil {
		_ = w.Abort(ctx)
	}
	return err
}

// beat refreshes the lock every l.every until stopped. A refresh that
// fails is tried again at the next beat; the gap it leaves is measured
// then.
func (l *Lock) beat() {
	defer close(l.done)
	t := time.NewTicker(l.every)
	defer t.Stop()
	for {
		select {
		case <-l.stop:
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), lockTimeout)
		_ = l.refresh(ctx)
		cancel()
	}
}

// refresh rewrites the lock object and records a lapse: the object gone,
// or older before than after by nearly StaleLock (others may have judged
// it stale in between).
func (l *Lock) refresh(ctx context.Context) error {
	before, err := l.st.Stat(ctx, l.name)
	missing := errors.Is(err, errdefs.ErrNotFound)
	if err != nil && !missing {
		return fmt.Errorf("refresh lock %s/%s: %w", l.st, l.name, err)
	}
	if err := l.put(ctx, false); err != nil {
		return fmt.Errorf("refresh lock %s/%s: %w", l.st, l.name, err)
	}
	after, err := l.st.Stat(ctx, l.name)
	if err != nil {
		return fmt.Errorf("refresh lock %s/%s: %w", l.st, l.name, err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.last, l.lastAt = after.Modified, l.clock()
	if l.lapse != nil {
		return nil
	}
	switch gap := after.Modified.Sub(before.Modified); {
	case missing:
		l.lapse = fmt.Errorf("the lock %s/%s was removed while its holder ran (gc takes a lock unrefreshed for %s for its holder's death): %w",
			l.st, l.name, l.stale, ErrLockLapsed)
	case gap > l.stale-l.every:
		l.lapse = fmt.Errorf("the lock %s/%s went unrefreshed for %s by the store's clock (from %s to %s), and counts as its holder's death after %s: %w",
			l.st, l.name, gap.Round(time.Second), before.Modified.UTC().Format(time.RFC3339), after.Modified.UTC().Format(time.RFC3339), l.stale, ErrLockLapsed)
	}
	return nil
}

// Confirm stops the refreshing, refreshes the lock a last time and says
// whether it stayed fresh all along: an error wrapping ErrLockLapsed if
// not, any error if the last refresh failed. A commit calls it before its
// final check of what it references: until Release, the lock is fresh
// for StaleLock more.
func (l *Lock) Confirm(ctx context.Context) error {
	if l == nil {
		return nil
	}
	l.stopBeat()
	if !l.unchanged(ctx) {
		if err := l.refresh(ctx); err != nil {
			return err
		}
	}
	return l.Lapsed()
}

// unchanged says the lock object is as the last refresh left it, under a
// quarter of StaleLock ago: fresh for longer than any commit takes, and
// never stale since.
func (l *Lock) unchanged(ctx context.Context) bool {
	info, err := l.st.Stat(ctx, l.name)
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.clock()
	return err == nil && info.Modified.Equal(l.last) && l.lastAt >= 0 && now >= 0 && now-l.lastAt < l.stale/4
}

// bootClock is the time since boot, suspended time included.
func bootClock() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return -1 // unknown: never unchanged
	}
	return time.Duration(ts.Nano())
}

// Lapsed is the lapse seen so far, nil if none.
func (l *Lock) Lapsed() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lapse
}

// stopBeat stops the refreshing goroutine and waits for it.
func (l *Lock) stopBeat() {
	l.stopOnce.Do(func() { close(l.stop) })
	<-l.done
}

// Release stops the refreshing and deletes the lock object, also when ctx
// has ended. A second Release does nothing; a nil Lock is released.
func (l *Lock) Release(ctx context.Context) {
	if l == nil {
		return
	}
	l.stopBeat()
	l.mu.Lock()
	released := l.released
	l.released = true
	l.mu.Unlock()
	if released {
		return
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), lockTimeout)
	defer cancel()
	_ = l.st.Delete(rctx, l.name)
}
