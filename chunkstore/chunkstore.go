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
//	gpucr-chunks/locks/<kind>-<32 hex> a capture's or gc's lock (lock.go)
package chunkstore

import (
	crand "crypto/rand"
	"encoding/hex"
	"strings"
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
