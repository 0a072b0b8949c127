//go:build gpucr_bench

package knobs

// The measuring build's variables (scripts/bench-files.sh builds it with
// -tags gpucr_bench), in the table only in that build.
var BenchSmallFiles = add(Knob{Name: "GPUCR_BENCH_SMALL_FILES",
	Meaning: "N: serve CRIU every image under N bytes as a file, to set its cost beside the pipe's (criusock)"})

var BenchStoreBackground = add(Knob{Name: "GPUCR_BENCH_STORE_BACKGROUND",
	Meaning: "N: the fast path's store keeps at most N chunks in flight beside CRIU's dump (streamer's LimitBackground), to set the bound"})
