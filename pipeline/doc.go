// Package pipeline holds what the two sides of the staged pipeline share,
// and what a checkpoint's writer and its reader must agree on byte for
// byte: the Options and Counters of a run, the Format an output writes
// (sealed, with or without chunk hashes), the chunk content hashes and
// file digests (Digester, FileDigest), how a session seals the manifest
// and a whole stream (seal.go), and the pipe sizing both directions use.
// The write side (package streamer) and the read side (package source)
// sit on top of it and import nothing of each other; it has no goroutines
// and no state beyond a small cache of zero-chunk sums.
package pipeline
