// Package gpuckpt is the GPU side of a checkpoint: the CUDA
// suspend/undo/resume policy around a CRIU dump and restore (cuda.go), the
// GPU fast path for processes that run with libgpucr-preload, their device
// memory as VRAM files of the checkpoint (vramfiles.go), and the `gpu`
// steps, one driver step or a tree's suspend and resume (gpu.go). Package
// checkpoint drives it around CRIU; the mechanisms are packages cudadriver
// (the driver's API) and vram (device memory out as VRAM files and back,
// through the preload library's control socket, package preloadctl).
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
