// Package chunkstore is a location's shared chunk store (format version 4,
// docs/FORMAT.md section 17): the chunks of every deduplicated checkpoint
// under one parent (a directory of checkpoint directories, an S3 prefix),
// each stored once, in packs, found through an index.
//
// The model is restic's: a chunk is named by its content id (BLAKE3-256 of
// its raw bytes); new chunks go into new packs; index objects map ids to a
// pack, an offset and lengths; every object is immutable once written and
// created exclusively under a random name, so that captures writing at the
// same moment never touch each other's objects and need no coordination
// but the locks that keep gc away (lock.go). A checkpoint's manifest, its
// commit point, names the packs it references.
//
// Objects, relative to the location:
//
//	gpucr-chunks/packs/<32 hex>.pack   a pack: a version 4 stream of DATA frames
//	gpucr-chunks/index/<32 hex>.idx    an index object (index.go)
//	gpucr-chunks/locks/<kind>-<32 hex> a capture's, check's or gc's lock (lock.go)
//
// # Where the chunk store's code is
//
// This package owns the objects and every rule about them, for each party
// that uses the store:
//
//	names of packs, index objects, locks  chunkstore.go
//	index objects, the table in memory    index.go (Load, WriteIndex, Table)
//	locks, and who may share with whom    lock.go
//	a capture: lookups, its index object  writer.go (Writer)
//	a reader: chunks gc moved             relocate.go (FindRepacked, Relocate)
//	gc: marks, repacking                  marks.go, repack.go (Marks.Repack)
//	check: the packs read, chunks found   scan.go (ScanPacks, CheckChunks)
//	cp: the copy's index object           index.go (IndexCheckpoint)
//
// Why not one package for all of it: an owner of everything would need
// streamer's segment writer (to write packs) and source's manifest reader
// (gc and check read every checkpoint's), so it would rank above them in
// cmd/gpucr-stream/layers_test.go; but streamer and source call the store
// (a capture looks up each chunk, a reader finds the chunks gc moved), so
// it must rank below them. This package is that lower half (rank 3: it
// imports codec, errdefs, manifest and store only). Four pieces sit above
// it, each in the package whose machinery it needs, each calling in here
// for the store's part:
//
//   - Writing packs, in streamer. A pack is a stream written by the
//     segment writer (ArchiveOutput in pack mode: lanes, uploads,
//     exclusive commits), the code that writes a plain archive's segments.
//     DedupOutput (streamer/dedup_output.go) is the capture's Output: it
//     puts each new chunk in a pack, asks a Writer about the others, and
//     commits the manifest as a plain archive's is (proved, exclusive).
//     PackWriter (streamer/pack_writer.go) writes gc's new packs for
//     Marks.Repack, through this package's PackWriter interface.
//   - Content-defined chunk boundaries (section 17.6), streamer/cdc.go.
//     The capture's producer cuts a file as it reads it, from the page
//     zero tests and CRC-32Cs that also give each chunk its sums; the cuts
//     serve every output that deduplicates: the chunk store's, and a
//     migration peer's chunk cache (transport/tcp's pre-copy), which is no
//     chunk store.
//   - Reading a deduplicated checkpoint, in source (archive.go, runs.go):
//     the read pipeline reads chunks from the location's packs by range,
//     as it reads segments, after FindRepacked.
//   - gc, check and cp of a location, in catalog (chunks.go, check.go,
//     copy.go; remove.go runs gc). They list a location's checkpoints and
//     read their manifests (source.ReadManifest), write packs (streamer),
//     decode checkpoints whole (check --read-data, through source), and
//     report; the lock, the index, the marks, the scan and the repacking
//     are calls here.
//
// location/open.go opens a DedupOutput for a --dedup capture.
package chunkstore

import (
	crand "crypto/rand"
	"encoding/hex"
	"iter"
	"strings"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
)

// Object name prefixes, relative to the location.
const (
	Dir         = "gpucr-chunks/"
	PackPrefix  = Dir + "packs/"
	IndexPrefix = Dir + "index/"
	LockPrefix  = Dir + "locks/"

	packSuffix  = ".pack"
	indexSuffix = ".idx"
)

// PackID names a pack: 16 random bytes.
type PackID [16]byte

// NewPackID is a fresh random pack id.
func NewPackID() PackID {
	var id PackID
	crand.Read(id[:])
	return id
}

// Name is the pack's object name in its location.
func (p PackID) Name() string { return PackPrefix + hex.EncodeToString(p[:]) + packSuffix }

// ParsePackName is the id of the pack object called name, and whether name
// is one.
func ParsePackName(name string) (PackID, bool) {
	return parseName(name, PackPrefix, packSuffix)
}

func parseName(name, prefix, suffix string) (PackID, bool) {
	var id PackID
	s, ok := strings.CutPrefix(name, prefix)
	if !ok {
		return id, false
	}
	s, ok = strings.CutSuffix(s, suffix)
	if !ok || len(s) != 2*len(id) || strings.ToLower(s) != s {
		return id, false
	}
	if _, err := hex.Decode(id[:], []byte(s)); err != nil {
		return id, false
	}
	return id, true
}

// newIndexName is a fresh index object name.
func newIndexName() string {
	id := NewPackID()
	return IndexPrefix + hex.EncodeToString(id[:]) + indexSuffix
}

// IsIndexName says name is an index object's.
func IsIndexName(name string) bool {
	_, ok := parseName(name, IndexPrefix, indexSuffix)
	return ok
}

// storedChunks yields each chunk of m that lies in a pack (all but zero
// chunks), with its file, for the caller to read or change in place.
func storedChunks(m *manifest.Manifest) iter.Seq2[*manifest.File, *manifest.Chunk] {
	return func(yield func(*manifest.File, *manifest.Chunk) bool) {
		for fi := range m.Files {
			f := &m.Files[fi]
			for ci := range f.Chunks {
				if c := &f.Chunks[ci]; codec.ID(c.Codec) != codec.Zero && !yield(f, c) {
					return
				}
			}
		}
	}
}
