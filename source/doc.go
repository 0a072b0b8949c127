// Package source is the read side of the staged pipeline: it serves the
// files of a checkpoint, every chunk checked (CRC-32C, and with
// VerifyHashes its content hash; opened first when sealed) before it is
// written, from a live stream of one or more shards (StreamSource) or from
// an archive's index (ArchiveSource), within a memory budget; into CRIU's
// pipe it splices its own pages rather than copying (splice.go). It also
// reads and checks manifests (ReadManifest, CheckManifest), describes a
// stream from its frame headers (ScanStream) and verifies a whole archive
// (VerifyArchive).
//
// The write side is package streamer; what both share is package
// pipeline. Source imports pipeline and nothing of streamer.
package source
