//go:build gpucr_bench

package gpuckpt

import "github.com/gpucr/gpucr-stream/knobs"

// A build for measuring only: GPUCR_BENCH_STORE_BACKGROUND=N bounds the
// store's chunks in flight at N instead of storeBackground's default.
func init() {
	if n := knobs.BenchStoreBackground.Int(); n != 0 {
		storeBackground = func() int { return n }
	}
}
