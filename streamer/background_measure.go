//go:build gpucr_bench

package streamer

import "github.com/gpucr/gpucr-stream/knobs"

// A build for measuring only: GPUCR_BENCH_BACKGROUND_CHUNKS=N bounds the
// background chunks in flight at N instead of one per worker.
func init() {
	backgroundChunks = knobs.BenchBackgroundChunks.Int()
}
