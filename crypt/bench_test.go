package crypt

import (
	"bytes"
	"crypto/rand"
	"testing"
)

// The cost of encryption per byte, on one goroutine (per core): sealing
// and opening 4 MiB chunks, the default chunk size. scripts/bench.sh prints
// it next to the codecs' per-core throughput.
const benchChunk = 4 << 20

func benchSession(b *testing.B) *Session {
	k, _ := NewKey(bytes.Repeat([]byte{9}, KeySize))
	s, err := NewSession(k)
	if err != nil {
		b.Fatal(err)
	}
	return s
}

func BenchmarkSeal(b *testing.B) {
	s := benchSession(b)
	buf := make([]byte, benchChunk, benchChunk+Overhead)
	rand.Read(buf)
	c := Chunk{FileID: 1, Name: "pages-1.img", RawLen: benchChunk, Codec: 0}
	b.SetBytes(benchChunk)
	for i := range b.N {
		c.Offset = uint64(i) * benchChunk // a new nonce each time, as in a checkpoint
		s.Seal(buf[:0], buf[:benchChunk], 1, c)
	}
}

func BenchmarkOpen(b *testing.B) {
	s := benchSession(b)
	plain := make([]byte, benchChunk)
	rand.Read(plain)
	c := Chunk{FileID: 1, Name: "pages-1.img", RawLen: benchChunk}
	sealed := s.Seal(nil, plain, 1, c)
	buf := make([]byte, len(sealed))
	b.SetBytes(benchChunk)
	for range b.N {
		copy(buf, sealed) // opened in place; the copy is counted (~3% of the time)
		if _, _, err := s.OpenChunk(buf, c); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkHash is the keyed BLAKE3 that replaces the plain content hash
// in an encrypted checkpoint: it should cost the same.
func BenchmarkHash(b *testing.B) {
	s := benchSession(b)
	buf := make([]byte, benchChunk)
	rand.Read(buf)
	b.SetBytes(benchChunk)
	for range b.N {
		s.Hash(buf)
	}
}

// BenchmarkSealSmall and BenchmarkSealSharedSmall compare, at the average
// size of a deduplicated checkpoint's chunks (320 KiB), sealing for one
// checkpoint with sealing for a chunk store, which derives a key per chunk.
const benchSmall = 320 << 10

func BenchmarkSealSmall(b *testing.B) {
	s := benchSession(b)
	buf := make([]byte, benchSmall, benchSmall+Overhead)
	rand.Read(buf)
	c := Chunk{FileID: 1, Name: "pages-1.img", RawLen: benchSmall}
	b.SetBytes(benchSmall)
	for i := range b.N {
		c.Offset = uint64(i) * benchSmall
		s.Seal(buf[:0], buf[:benchSmall], 1, c)
	}
}

func BenchmarkSealSharedSmall(b *testing.B) {
	s := benchSession(b)
	plain := make([]byte, benchSmall, benchSmall+4) // room for the CRC, as a capture's buffers have
	rand.Read(plain)
	dst := make([]byte, 0, benchSmall+PackOverhead)
	b.SetBytes(benchSmall)
	for range b.N {
		s.SealShared(dst, plain, 1, [32]byte{1}, benchSmall, 0)
	}
}
