// Package testwait scales how long tests wait for what they wait on. A
// deadline that guards a test against a hang (a context's, a select's)
// was written for an idle machine; on a loaded one the same work takes
// several times as long, and the test failed though nothing hung. Tests
// wait Scale(d) instead of d: the bug the deadline guards (a hang) still
// fails them, later.
//
// Deadlines that are what a test checks (a transfer that must not wait for
// a retry's 11 s, a timer the code under test sets) are not for Scale:
// they would stop catching the slowness they guard.
package testwait

import (
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Env names the variable that sets the factor: GPUCR_TEST_SLOW=4 makes
// every scaled wait four times as long.
const Env = "GPUCR_TEST_SLOW"

// Factor is what Scale multiplies by: $GPUCR_TEST_SLOW where it is a
// number above 0, else the load of the machine when first asked (the
// 1-minute load average per CPU), at least 1.
var Factor = sync.OnceValue(factor)

func factor() float64 {
	if f, err := strconv.ParseFloat(os.Getenv(Env), 64); err == nil && f > 0 {
		return f
	}
	return max(1, loadPerCPU())
}

// loadPerCPU is the 1-minute load average over the CPUs this process may
// use; 0 where unknown.
func loadPerCPU() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	load, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return 0
	}
	return load / float64(runtime.NumCPU())
}

// Scale is d times Factor.
func Scale(d time.Duration) time.Duration {
	return time.Duration(float64(d) * Factor())
}
