package vram

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
)

// TestHashBlockVector: the host's hash is the library's (preload/devhash.h
// dh_block, run as C for these values).
func TestHashBlockVector(t *testing.T) {
	w := make([]byte, 1024*8)
	for i := range 1024 {
		binary.LittleEndian.PutUint64(w[8*i:], uint64(i)*0x0123456789abcdef^0x5555)
	}
	for _, tc := range []struct {
		n    int
		key  uint64
		want blockHash
	}{
		{1024, 0x1234, blockHash{0xe186d445539ca114, 0xd59376caae226d70}},
		{3, 0, blockHash{0xac74914f574431bd, 0xd1254a490d269843}},
		// whole rounds of four words and a tail, the key's sums wrapping
		{1023, 0xffffffffffffffff, blockHash{0x54ee2d650f603437, 0x50985508e1394a24}},
		{7, 1, blockHash{0x748ed9f73d36b1e6, 0x52d0a67b3f405cc2}},
	} {
		if got := hashBlock(w[:8*tc.n], tc.key); got != tc.want {
			t.Errorf("%d words under %#x: %x, want %x", tc.n, tc.key, got, tc.want)
		}
	}
}

// dataPiece is one piece of a synthetic VRAM file: its address, size,
// block, and its bytes (nil: the block is not stored).
type dataPiece struct {
	va, block uint64
	blocks    [][]byte
}

func (p dataPiece) size() uint64 {
	var n uint64
	for _, b := range p.blocks {
		if b == nil {
			n += p.block
		} else {
			n += uint64(len(b))
		}
	}
	return n
}

// vramFile writes pieces as the library does (GPUCRVM3); with holes, the
// blocks in holes are left zero in the file, as a copy out that left them
// out leaves them.
func vramFile(pieces []dataPiece, holes func(va uint64) bool) []byte {
	var f bytes.Buffer
	f.WriteString(magicV3)
	for _, p := range pieces {
		nb := (len(p.blocks) + 7) / 8
		hdr := make([]byte, 32+nb)
		binary.LittleEndian.PutUint64(hdr, p.va)
		binary.LittleEndian.PutUint64(hdr[8:], p.size())
		binary.LittleEndian.PutUint64(hdr[16:], p.block)
		for b, d := range p.blocks {
			if d == nil {
				hdr[32+b/8] |= 1 << (b % 8)
			}
		}
		f.Write(hdr)
		f.Write(make([]byte, (align-f.Len()%align)%align))
		for b, d := range p.blocks {
			switch {
			case d == nil:
			case holes != nil && holes(p.va+uint64(b)*p.block):
				f.Write(make([]byte, len(d)))
			default:
				f.Write(d)
			}
		}
	}
	f.Write(make([]byte, 32))
	return f.Bytes()
}

func randBlock(r *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// memEarlier is an earlier checkpoint held in memory.
func memEarlier(h *BlockHashes, files ...[]byte) *Earlier {
	names := make([]string, len(files))
	for i := range files {
		names[i] = "vram-1-0" + string(rune('0'+i)) + ".bin"
	}
	return &Earlier{Name: "mem/one", Hashes: h, Files: names, Open: func(_ context.Context, name string) (io.ReaderAt, error) {
		for i, n := range names {
			if n == name {
				return bytes.NewReader(files[i]), nil
			}
		}
		return nil, errdefs.ErrNotFound
	}}
}

// TestCompose: a file composed from a kept copy with holes and the earlier
// checkpoint's blocks is the file a whole copy makes; its hashes are the
// same; a block of the earlier checkpoint that is not what its record
// says fails the composition, never goes into the file.
func TestCompose(t *testing.T) {
	ctx := context.Background()
	r := rand.New(rand.NewPCG(1, 2))
	const blk = 8192
	old := []dataPiece{
		{va: 1 << 30, block: blk, blocks: [][]byte{randBlock(r, blk), nil, randBlock(r, blk), randBlock(r, blk)}},
		{va: 1<<30 + 4*blk, block: blk, blocks: [][]byte{randBlock(r, blk), randBlock(r, 4096)}},
	}
	oldFile := vramFile(old, nil)
	c := &composer{key: 77}
	ps, err := c.compose(ctx, 0, bytes.NewReader(oldFile), int64(len(oldFile)), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	earlier := newBlockHashes(77, 1, [][]hashedPiece{ps})
	b, _ := earlier.MarshalBinary()
	if back, err := ParseBlockHashes(b); err != nil || back.CheckFiles([]int64{int64(len(oldFile))}) != nil || back.Bytes() != 3*blk+blk+4096 {
		t.Fatalf("round trip: %+v %v", back, err)
	}
	// New memory: the first piece's last block rewritten, a zero block
	// written; the second piece unchanged.
	cur := []dataPiece{
		{va: 1 << 30, block: blk, blocks: [][]byte{old[0].blocks[0], randBlock(r, blk), old[0].blocks[2], randBlock(r, blk)}},
		old[1],
	}
	want := vramFile(cur, nil)
	skip := &skipSet{block: blk, maps: []devMap{{va: 1 << 30, size: 6 * blk, bits: []byte{1<<0 | 1<<2 | 1<<4 | 1<<5, 0, 0, 0, 0, 0, 0, 0}}}}
	kept := vramFile(cur, skip.has)
	e := memEarlier(earlier, oldFile)
	var got bytes.Buffer
	c = &composer{key: 77, skip: skip, earlier: e}
	nps, err := c.compose(ctx, 0, bytes.NewReader(kept), int64(len(kept)), &got)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), want) {
		t.Fatalf("composed %d bytes, differ from the whole file's %d", got.Len(), len(want))
	}
	whole, err := (&composer{key: 77}).compose(ctx, 0, bytes.NewReader(want), int64(len(want)), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	a, _ := newBlockHashes(77, 1, [][]hashedPiece{nps}).MarshalBinary()
	w, _ := newBlockHashes(77, 1, [][]hashedPiece{whole}).MarshalBinary()
	if !bytes.Equal(a, w) {
		t.Fatal("the composed file's block hashes are not the whole file's")
	}
	// A byte of the earlier checkpoint's block 2 changed.
	bad := bytes.Clone(oldFile)
	bad[bytes.Index(oldFile, old[0].blocks[2])+100] ^= 1
	e = memEarlier(earlier, bad)
	got.Reset()
	c = &composer{key: 77, skip: skip, earlier: e}
	if _, err := c.compose(ctx, 0, bytes.NewReader(kept), int64(len(kept)), &got); !errors.Is(err, errdefs.ErrCorrupt) {
		t.Fatalf("compose from a damaged block: %v", err)
	}
	if bytes.Contains(got.Bytes(), bad[bytes.Index(oldFile, old[0].blocks[2]):][:blk]) {
		t.Fatal("the damaged block went into the file")
	}
}

// TestUnchanged: a block is left out only where it was offered, the
// earlier checkpoint stored it in a piece of the same address, size and
// block, and the hashes are equal (and not zero).
func TestUnchanged(t *testing.T) {
	const blk = 64 << 10
	const per = maxPiece / blk
	h := func(i uint64) blockHash { return blockHash{i, i * 3} }
	// The earlier checkpoint: a whole piece whose block 1 it did not
	// store and whose block 3 has no hash, then a piece in other blocks.
	first := hashedPiece{va: 1 << 32, size: maxPiece, block: blk, unstored: make([]byte, per/8)}
	first.unstored[0] = 1 << 1
	for b := uint64(0); b < per; b++ {
		switch b {
		case 0:
			first.hashes = append(first.hashes, h(1))
		case 1:
		case 2:
			first.hashes = append(first.hashes, h(3))
		case 3:
			first.hashes = append(first.hashes, blockHash{})
		default:
			first.hashes = append(first.hashes, h(100+b))
		}
	}
	earlier := &BlockHashes{Key: 5, Files: 1, pieces: []hashedPiece{first,
		{va: 1<<32 + maxPiece, size: 2 * blk, block: 2 * blk, unstored: []byte{0}, hashes: []blockHash{h(7)}}}}
	// The device: one mapping of both pieces; blocks 0-3, 5 (equal, its
	// hash found past the block not stored) and the second piece's first
	// offered, block 4 (equal) not.
	m := devMap{va: 1 << 32, size: maxPiece + 2*blk, bits: make([]byte, per/8+8), hashes: make([]blockHash, per+2)}
	for _, b := range []int{0, 1, 2, 3, 5, per} {
		m.bits[b/8] |= 1 << (b % 8)
	}
	m.hashes[0], m.hashes[1], m.hashes[2], m.hashes[3], m.hashes[4], m.hashes[5], m.hashes[per] = h(1), h(2), h(4), blockHash{}, h(104), h(105), h(7)
	dev := &deviceHashes{key: 5, block: blk, maps: []devMap{m}}
	s := unchanged(dev, earlier)
	if s == nil || s.bytes != 2*blk || !s.has(1<<32) || s.has(1<<32+blk) || s.has(1<<32+4*blk) || !s.has(1<<32+5*blk) || s.has(1<<32+maxPiece) {
		t.Fatalf("left out %+v, want blocks 0 and 5", s)
	}
	if unchanged(&deviceHashes{key: 6, block: blk, maps: dev.maps}, earlier) != nil {
		t.Fatal("hashes under another key compared")
	}
	b, _ := s.MarshalBinary()
	back, err := parseSkip(b)
	if err != nil || back.bytes != s.bytes || !back.has(1<<32) || back.has(1<<32+blk) {
		t.Fatalf("skip file round trip: %+v %v", back, err)
	}
}

// FuzzParseBlockHashes: untrusted bytes (a checkpoint's) never panic,
// and what parses writes back as it was read.
func FuzzParseBlockHashes(f *testing.F) {
	h := &BlockHashes{Key: 9, Files: 2, pieces: []hashedPiece{
		{file: 1, va: 4096, size: 3 * 4096, block: 4096, data: 4096, unstored: []byte{2}, hashes: []blockHash{{1, 2}, {3, 4}}},
		{file: 0, va: 1 << 20, size: 100, block: 4096, data: 8192, unstored: []byte{0}, hashes: []blockHash{{5, 6}}},
	}}
	b, _ := h.MarshalBinary()
	f.Add(b)
	f.Add(b[:40])
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := ParseBlockHashes(b)
		if err != nil {
			return
		}
		_ = h.CheckFiles([]int64{1 << 20, 1 << 20})
		_ = h.Bytes()
		back, _ := h.MarshalBinary()
		if !bytes.Equal(back, b) {
			t.Fatalf("parsed and written back: %x, read %x", back, b)
		}
	})
}

// FuzzParseDeviceHashes: what the library writes is untrusted.
func FuzzParseDeviceHashes(f *testing.F) {
	var b bytes.Buffer
	b.WriteString(magicDevHashes)
	for _, v := range []uint64{3, 4096, 1, 1 << 20, 8192, 1, 1, 2, 3, 4} {
		b.Write(binary.LittleEndian.AppendUint64(nil, v))
	}
	f.Add(b.Bytes())
	f.Fuzz(func(t *testing.T, b []byte) {
		dev, err := parseDeviceHashes(b)
		if err != nil {
			return
		}
		earlier := &BlockHashes{Key: dev.key, Files: 1, pieces: []hashedPiece{{va: 1 << 20, size: 8192, block: 4096, unstored: []byte{0}, hashes: []blockHash{{1, 2}, {3, 4}}}}}
		if s := unchanged(dev, earlier); s != nil {
			_, _ = s.MarshalBinary()
			s.has(1 << 20)
		}
	})
}

// FuzzParseSkip: a skip file read back from the kept copy's directory.
func FuzzParseSkip(f *testing.F) {
	s := &skipSet{block: 4096, maps: []devMap{{va: 1 << 20, size: 3 * 4096, bits: []byte{5, 0, 0, 0, 0, 0, 0, 0}}}}
	b, _ := s.MarshalBinary()
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := parseSkip(b)
		if err != nil {
			return
		}
		s.has(1 << 20)
		s.has(0)
	})
}

// FuzzCompose: a kept file is written by the process's library
// (untrusted): composing any bytes never panics, and never reads past
// what it is given.
func FuzzCompose(f *testing.F) {
	r := rand.New(rand.NewPCG(3, 4))
	p := []dataPiece{{va: 1 << 30, block: 4096, blocks: [][]byte{randBlock(r, 4096), nil, randBlock(r, 4096)}}}
	old := vramFile(p, nil)
	ps, _ := (&composer{key: 1}).compose(context.Background(), 0, bytes.NewReader(old), int64(len(old)), io.Discard)
	e := memEarlier(newBlockHashes(1, 1, [][]hashedPiece{ps}), old)
	skip := &skipSet{block: 4096, maps: []devMap{{va: 1 << 30, size: 3 * 4096, bits: []byte{1, 0, 0, 0, 0, 0, 0, 0}}}}
	f.Add(vramFile(p, skip.has))
	f.Add(old)
	f.Fuzz(func(t *testing.T, b []byte) {
		c := &composer{key: 1, skip: skip, earlier: e}
		_, _ = c.compose(context.Background(), 0, bytes.NewReader(b), int64(len(b)), io.Discard)
	})
}

// BenchmarkHashBlock: the host's device hash of 64 KiB blocks, as the
// store runs it on every block it reads.
func BenchmarkHashBlock(b *testing.B) {
	buf := randBlock(rand.New(rand.NewPCG(5, 6)), 64<<10)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		hashBlock(buf, 3)
	}
}
