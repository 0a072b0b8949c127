//go:build gpucr_bench

package criusock

import "github.com/gpucr/gpucr-stream/knobs"

// A build for measuring only (scripts/bench-files.sh builds it with
// -tags gpucr_bench): GPUCR_BENCH_SMALL_FILES=N serves every image under N
// bytes as a file, to set its cost through CRIU beside the pipe's.
func init() {
	smallAsFile = int64(knobs.BenchSmallFiles.Int())
}
