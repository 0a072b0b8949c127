package vram

import (
	"bytes"
	"context"
	"errors"
	"hash/crc32"
	"io"
	"iter"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
)

// chunkMem is a location's chunk store in memory, as the capture's
// WriteCuts uses it: a cut's bytes are a new chunk, a cut without them
// must name one it holds. Visits run on goroutines of their own, as on
// the capture's workers.
type chunkMem struct {
	mu     sync.Mutex
	byID   map[[32]byte][]byte
	chunks map[string][]manifest.Chunk // each file's, as its manifest lists them
	read   int64                       // bytes Fill read
}

func newChunkMem() *chunkMem {
	return &chunkMem{byID: map[[32]byte][]byte{}, chunks: map[string][]manifest.Chunk{}}
}

func (m *chunkMem) knows(id [32]byte) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.byID[id]
	return ok
}

// cutPut is a CutPut of chunkSize into m.
func (m *chunkMem) cutPut(chunkSize int) *CutPut {
	return &CutPut{Knows: m.knows, ChunkSize: chunkSize, Put: func(_ context.Context, name string, cuts iter.Seq2[Cut, error]) error {
		var visits sync.WaitGroup
		var off int64
		var list []manifest.Chunk
		defer visits.Wait()
		for cut, err := range cuts {
			if err != nil {
				return err
			}
			if cut.Len <= 0 || cut.Len > chunkSize {
				return errors.New("a cut over the chunk size")
			}
			c := manifest.Chunk{Offset: off, RawLen: uint32(cut.Len), Hash: cut.Hash, Checksum: cut.CRC}
			if cut.Fill == nil {
				if !m.knows(cut.Hash) {
					return errors.New("a cut names a chunk the store does not hold")
				}
			} else {
				b := make([]byte, cut.Len)
				if err := cut.Fill(b); err != nil {
					return err
				}
				m.read += int64(len(b))
				c.Hash, c.Checksum = codec.ContentHash(b), crc32.Checksum(b, crc32.MakeTable(crc32.Castagnoli))
				m.mu.Lock()
				m.byID[c.Hash] = b
				m.mu.Unlock()
				if cut.Visit != nil {
					visits.Go(func() { cut.Visit(b) })
				}
			}
			list = append(list, c)
			off += int64(cut.Len)
		}
		visits.Wait()
		m.chunks[name] = list
		return nil
	}}
}

// file is what the chunks of name hold.
func (m *chunkMem) file(name string) []byte {
	var b []byte
	for _, c := range m.chunks[name] {
		b = append(b, m.byID[c.Hash]...)
	}
	return b
}

// storeCuts stores the kept file kept as name through cp, as the store
// does: the file's hashed pieces, or the error.
func storeCuts(c *composer, kept []byte, cp *CutPut, name string) ([]hashedPiece, error) {
	f := newFileCuts(context.Background(), c, 0, bytes.NewReader(kept), int64(len(kept)), cp)
	var err error
	if cp != nil {
		err = cp.Put(context.Background(), name, f.all)
	} else {
		next, stop := iter.Pull2(iter.Seq2[Cut, error](f.all))
		_, err = io.Copy(io.Discard, &cutsReader{next: next})
		stop()
	}
	if err == nil {
		err = f.check()
	}
	return f.hashed(), err
}

// TestStoreCuts: a --dedup store cuts a VRAM file at its device blocks:
// the first checkpoint's chunks hold its bytes and its hashes are those
// of every block (also of blocks split over chunks, summed from their
// parts); the second names the first's chunks for every group that did
// not change and reads only the changed groups, and makes the file and
// hashes a whole copy makes; from an earlier checkpoint that is not cut
// so it reads the left-out blocks back, and one of them damaged fails
// the store.
func TestStoreCuts(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	const blk = 8192
	blocks := func(n int) [][]byte {
		var bs [][]byte
		for range n {
			bs = append(bs, randBlock(r, blk))
		}
		return bs
	}
	old := []dataPiece{
		{va: 1 << 30, block: blk, blocks: blocks(40)},
		{va: 1<<30 + 64*blk, block: blk, blocks: append(blocks(9), randBlock(r, 4096))},
	}
	old[0].blocks[5] = nil
	oldFile := vramFile(old, nil)
	for _, chunk := range []int{32 * blk, 4096} { // groups of 4 blocks; blocks split in two
		m := newChunkMem()
		ps, err := storeCuts(&composer{key: 9}, oldFile, m.cutPut(chunk), "f")
		if err != nil || !bytes.Equal(m.file("f"), oldFile) {
			t.Fatalf("chunks of %d: the first store: %v, %d bytes", chunk, err, len(m.file("f")))
		}
		whole, err := (&composer{key: 9}).compose(context.Background(), 0, bytes.NewReader(oldFile), int64(len(oldFile)), io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		a, _ := newBlockHashes(9, 1, [][]hashedPiece{ps}).MarshalBinary()
		w, _ := newBlockHashes(9, 1, [][]hashedPiece{whole}).MarshalBinary()
		if !bytes.Equal(a, w) {
			t.Fatalf("chunks of %d: the block hashes are not a whole file's", chunk)
		}
	}

	// Blocks 1 and 30 of the first piece rewritten, block 5 stored now
	// (so the blocks after it have other places among the first's hashes
	// and bytes); a left-out block (all the rest is left out).
	cur := []dataPiece{{va: old[0].va, block: blk, blocks: append([][]byte(nil), old[0].blocks...)}, old[1]}
	cur[0].blocks[1], cur[0].blocks[5], cur[0].blocks[30] = randBlock(r, blk), randBlock(r, blk), randBlock(r, blk)
	want := vramFile(cur, nil)
	skip := &skipSet{block: blk, maps: []devMap{
		{va: cur[0].va, size: cur[0].size(), bits: make([]byte, 8)},
		{va: cur[1].va, size: cur[1].size(), bits: make([]byte, 8)},
	}}
	for i, p := range cur {
		for b, d := range p.blocks {
			if d != nil && !(i == 0 && (b == 1 || b == 5 || b == 30)) {
				skip.maps[i].bits[b/8] |= 1 << (b % 8)
			}
		}
	}
	kept := vramFile(cur, skip.has)
	const chunk = 32 * blk
	m := newChunkMem()
	ps, err := storeCuts(&composer{key: 9}, oldFile, m.cutPut(chunk), "one")
	if err != nil {
		t.Fatal(err)
	}
	earlier := newBlockHashes(9, 1, [][]hashedPiece{ps})
	e := memEarlier(earlier, oldFile)
	e.Chunks = [][]manifest.Chunk{m.chunks["one"]}
	m.read = 0
	got, err := storeCuts(&composer{key: 9, skip: skip, earlier: e}, kept, m.cutPut(chunk), "two")
	if err != nil || !bytes.Equal(m.file("two"), want) {
		t.Fatalf("the second store: %v; its chunks hold the file: %v", err, bytes.Equal(m.file("two"), want))
	}
	whole, _ := (&composer{key: 9}).compose(context.Background(), 0, bytes.NewReader(want), int64(len(want)), io.Discard)
	a, _ := newBlockHashes(9, 1, [][]hashedPiece{got}).MarshalBinary()
	w, _ := newBlockHashes(9, 1, [][]hashedPiece{whole}).MarshalBinary()
	if !bytes.Equal(a, w) {
		t.Fatal("the second store's block hashes are not a whole file's")
	}
	// Read: the bytes before each piece's data and the end, and the three
	// groups of 4 blocks that changed.
	if most := int64(3*2*align + 3*4*blk); m.read > most {
		t.Fatalf("the second store read %d bytes, want at most %d", m.read, most)
	}
	t.Logf("the second store read %d of the file's %d bytes", m.read, len(want))

	// An earlier checkpoint with other chunks (none named): the blocks
	// left out are read back from it and checked, through a plain put too.
	e.Chunks = nil
	for _, cp := range []*CutPut{m.cutPut(chunk), nil} {
		got, err = storeCuts(&composer{key: 9, skip: skip, earlier: e}, kept, cp, "three")
		a, _ = newBlockHashes(9, 1, [][]hashedPiece{got}).MarshalBinary()
		if err != nil || !bytes.Equal(a, w) || cp != nil && !bytes.Equal(m.file("three"), want) {
			t.Fatalf("from an earlier checkpoint cut otherwise: %v", err)
		}
	}
	bad := bytes.Clone(oldFile)
	bad[bytes.Index(oldFile, old[0].blocks[7])+100] ^= 1
	e = memEarlier(earlier, bad)
	for _, cp := range []*CutPut{m.cutPut(chunk), nil} {
		if _, err := storeCuts(&composer{key: 9, skip: skip, earlier: e}, kept, cp, "four"); !errors.Is(err, errdefs.ErrCorrupt) {
			t.Fatalf("from a damaged earlier checkpoint: %v", err)
		}
	}
}

// FuzzStoreCuts: a kept file is written by the process's library
// (untrusted): cutting any bytes never panics, never reads past what it
// is given, and never makes a cut over the chunk size.
func FuzzStoreCuts(f *testing.F) {
	r := rand.New(rand.NewPCG(3, 4))
	p := []dataPiece{{va: 1 << 30, block: 4096, blocks: [][]byte{randBlock(r, 4096), nil, randBlock(r, 4096)}}}
	old := vramFile(p, nil)
	m := newChunkMem()
	ps, _ := storeCuts(&composer{key: 1}, old, m.cutPut(8192), "one")
	e := memEarlier(newBlockHashes(1, 1, [][]hashedPiece{ps}), old)
	e.Chunks = [][]manifest.Chunk{m.chunks["one"]}
	skip := &skipSet{block: 4096, maps: []devMap{{va: 1 << 30, size: 3 * 4096, bits: []byte{1, 0, 0, 0, 0, 0, 0, 0}}}}
	f.Add(vramFile(p, skip.has))
	f.Add(old)
	f.Fuzz(func(t *testing.T, b []byte) {
		_, _ = storeCuts(&composer{key: 1, skip: skip, earlier: e}, b, m.cutPut(8192), "f")
	})
}
