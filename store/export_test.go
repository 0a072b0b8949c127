package store

import "time"

// SetClock replaces l's clock (bootClock), for tests of a holder frozen
// for hours, and dates l's last refresh by it: left at bootClock's time of
// the take, the machine's uptime, a holder away 6 h on a host up 5 h was
// back "under 1.5 h" after its refresh (TestFrozenHolder failed on hosts
// up longer than 4.5 h).
func SetClock(l *Lock, clock func() time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.clock = clock
	l.lastAt = clock()
}
