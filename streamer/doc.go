// Package streamer is the staged pipeline engine: it cuts image files into
// chunks, encodes them on a pool of workers within a memory budget, writes
// frames in order to an output, and runs the same stages backwards to serve
// files from a stream or an indexed archive. It knows nothing of CRIU or of
// particular storage systems; those plug in through Output, store.Store and
// the io interfaces.
package streamer
