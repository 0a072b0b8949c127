//go:build gpucr_bench

package knobs

// The measuring build's variables (scripts/bench-files.sh builds it with
// -tags gpucr_bench), in the table only in that build.
var BenchSmallFiles = add(Knob{Name: "GPUCR_BENCH_SMALL_FILES",
	Meaning: "N: serve CRIU every image under N bytes as a file, to set its cost beside the pipe's (criusock)"})

var BenchBackgroundChunks = add(Knob{Name: "GPUCR_BENCH_BACKGROUND_CHUNKS",
	Meaning: "N: a capture's background files (the fast path's store) keep at most N chunks in flight instead of one per worker, to set the bound"})
