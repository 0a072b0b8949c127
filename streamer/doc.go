// Package streamer is the staged pipeline engine: it cuts image files into
// chunks, encodes them on a pool of workers within a memory budget, writes
// frames in order to an output, and runs the same stages backwards to serve
// files from a stream or an indexed archive. It knows nothing of CRIU or of
// particular storage systems; those plug in through Output, store.Store and
// the io interfaces.
//
// Size: about 2,500 lines, over the project's 1,500, on purpose for now.
// Both directions share Options, Counters, the chunk sums and decode, and
// the splice path (splice.go); the natural cut is the write side (Capture,
// the Outputs, BufferPool) from the read side (the Sources, ReadManifest,
// ScanStream, VerifyArchive), which changes the imports of every command
// and is left until the restructure of cmd (issue 10) has landed.
package streamer
