package swrk

// The container's cgroup frozen ahead of CRIU's dump (cgroup v2).
//
// CRIU freezes the --freeze-cgroup that runc names itself: it writes
// cgroup.freeze, reads the state back at once and, the kernel not having
// finished (a fraction of a millisecond), sleeps in 100 ms steps
// (seize.c, freeze_processes). So nearly every dump waits 100 ms with
// the container already frozen. A v2 cgroup says when it is frozen:
// cgroup.events changes, which wakes a poll. The swrk freezes the cgroup
// and waits for that before CRIU starts; CRIU finds it frozen and goes
// straight on to seize its tasks.
//
// CRIU then takes the cgroup for one its user froze: where the tree lives
// on (--leave-running, or a failed dump) it leaves it frozen, so the swrk
// thaws what it froze once CRIU is done, before the runtime hears the
// answer. A cgroup already frozen (runc pause) is not touched: CRIU keeps
// its state as it would. A freeze not complete within freezeWait is
// undone, and CRIU freezes as it would (one found half frozen it would
// take as frozen, and seize tasks still running).
//
// Cgroup v1 is left to CRIU: it records the freezer state it found in the
// image (freezer.state), and a restore that sets cgroup properties would
// bring the container back frozen. With v2 it records cgroup.freeze after
// seizing the tasks, when it has thawed the cgroup either way.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// freezeWait bounds the wait for a cgroup to freeze.
var freezeWait = 500 * time.Millisecond

// freezeAhead freezes the v2 cgroup dir and waits until it is frozen. It
// returns what undoes that (a no-op where it did nothing: dir is no v2
// cgroup, it is frozen already, or it did not freeze in time).
func freezeAhead(ctx context.Context, dir string) (thaw func() error) {
	nothing := func() error { return nil }
	if dir == "" {
		return nothing
	}
	freeze := filepath.Join(dir, "cgroup.freeze")
	if b, err := os.ReadFile(freeze); err != nil || string(bytes.TrimSpace(b)) != "0" {
		return nothing // v1, gone, or frozen by someone else
	}
	events, err := os.Open(filepath.Join(dir, "cgroup.events"))
	if err != nil {
		return nothing
	}
	defer events.Close()
	if os.WriteFile(freeze, []byte("1"), 0) != nil {
		return nothing
	}
	thaw = func() error {
		if err := os.WriteFile(freeze, []byte("0"), 0); err != nil {
			return fmt.Errorf("thaw cgroup %s, frozen for CRIU's dump: %w", dir, err)
		}
		return nil
	}
	if frozenWithin(ctx, events, freezeWait) {
		return thaw
	}
	if thaw() != nil {
		return thaw // tried again once CRIU is done, and then reported
	}
	return nothing
}

// frozenWithin waits up to d for cgroup.events (open in events) to say
// "frozen 1".
func frozenWithin(ctx context.Context, events *os.File, d time.Duration) bool {
	deadline := time.Now().Add(d)
	buf := make([]byte, 512)
	for ctx.Err() == nil {
		n, err := events.ReadAt(buf, 0)
		if err != nil && n == 0 {
			return false
		}
		if frozen(buf[:n]) {
			return true
		}
		left := time.Until(deadline)
		if left <= 0 {
			return false
		}
		// kernfs wakes a POLLPRI waiter when the file changes.
		fds := []unix.PollFd{{Fd: int32(events.Fd()), Events: unix.POLLPRI}}
		if _, err := unix.Poll(fds, int(min(left, 10*time.Millisecond)/time.Millisecond)+1); err != nil && !errors.Is(err, unix.EINTR) {
			return false
		}
	}
	return false
}

// frozen says whether cgroup.events says "frozen 1".
func frozen(events []byte) bool {
	for line := range bytes.Lines(events) {
		if string(bytes.TrimSpace(line)) == "frozen 1" {
			return true
		}
	}
	return false
}
