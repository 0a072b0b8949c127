package store

import "time"

// SetClock replaces l's clock (bootClock), for tests of a holder frozen
// for hours.
func SetClock(l *Lock, clock func() time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.clock = clock
}
