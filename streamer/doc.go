// Package streamer is the write side of the staged pipeline: a Capture
// cuts image files into chunks, encodes (and seals) them on a pool of
// workers within a memory budget, and writes frames in order to an Output:
// a stream over one or more shards (StreamOutput), an archive's segments in
// a store.Store (ArchiveOutput), or both at once (TeeOutput). It knows
// nothing of CRIU or of particular storage systems; those plug in through
// Output, store.Store and the io interfaces.
//
// The read side, which runs the same stages backwards to serve files from
// a stream or an archive, is package source; what both sides share (the
// Options, Counters, Format, chunk and file digests, the sealing
// conventions) is package pipeline, below both. The two sides import
// neither each other nor anything above pipeline, so that a reader links
// no writer and each stays under the project's size for one package.
package streamer
