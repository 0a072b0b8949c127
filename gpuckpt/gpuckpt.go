// Package gpuckpt is the GPU side of a checkpoint, and the one home of its
// policy: which steps suspend a tree's GPU state, in which order, and what
// is undone when. The steps of a suspend are one table (suspend.go: the
// fast path's, for processes that run with libgpucr-preload, then the
// driver's lock and checkpoint, driver.go) run on one undo stack
// (undo.go), which undoes them, the last first, when a step fails, when
// the dump fails after them, or after a dump that leaves the processes
// running; where a failed undo leaves each process is stuck.go's. Around
// that: the CUDA processes of a tree and their GPUs (cuda.go), the
// resume after a restore, onto other GPUs where a map says so (cuda.go,
// driver.go), the device memory as VRAM files of a checkpoint and back
// (vramfiles.go, stage.go, inspect.go), the refusal of trees the driver
// could not undo (oneway.go), and the `gpu` steps, one driver step or a
// tree's suspend and resume (gpu.go). Package checkpoint drives it around
// CRIU; the mechanisms are packages cudadriver (the driver's API, one
// process and one step at a time) and vram (each step of the fast path
// and its inverse, through the library's control socket, package
// preloadctl).
// The name says what it holds: the GPU's part of checkpointing (gpu +
// ckpt), not the whole checkpoint, and not only CUDA's policy.
package gpuckpt

// Phase is one timed step of a checkpoint or restore.
type Phase struct {
	Name string  `json:"name"`
	Secs float64 `json:"seconds"`
}

// say hands s to log, which may be nil.
func say(log func(string), s string) {
	if log != nil {
		log(s)
	}
}
