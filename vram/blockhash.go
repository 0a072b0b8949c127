package vram

// Block hashes: the library's device hash (preload/devhash.h) computed
// here on the host, and a --dedup checkpoint's record of its VRAM files
// by block, with each stored block's hash (BlockHashes, the file
// vram-PID.hashes): what the next --dedup checkpoint of the process into
// the same location compares the device's hashes with, to find the blocks
// it need not copy out (unchanged.go), and checks the bytes it reads back
// against. The record is gpucr-stream's own: it hashes every stored block
// as it stores it, never trusting the library's hashes for it.

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"fmt"
	"math/bits"
	"slices"
	"sort"
)

// The constants of preload/devhash.h.
const (
	dhK1 = 0x9E3779B97F4A7C15
	dhK2 = 0xD6E8FEB86659FD93
)

// blockHash is a block's two 64-bit lanes (devhash.h's a and b). The zero
// value stands for no hash: a block with that hash is never taken as
// unchanged (about 2^-128 of them, copied needlessly).
type blockHash [2]uint64

// hashBlock is dh_block over b (whole 64-bit words, little-endian) under
// key: what the library's kernel computes for a block on the device.
func hashBlock(b []byte, key uint64) blockHash { return hashWords(b, key, 0) }

// hashWords is the part of dh_block that the words of b make, b starting
// at word first of its block: a block's hash is the sum, lane by lane, of
// its parts'. Four words a round, the products i*K1 and i*K2 carried as
// sums: every block a checkpoint stores or reads back from an earlier one
// goes through it.
func hashWords(b []byte, key, first uint64) blockHash {
	var a0, a1, a2, a3, c0, c1, c2, c3 uint64
	k1, k2 := key+first*dhK1, first*dhK2 // i*K1 + key, i*K2
	m1, m2 := uint64(dhK1), uint64(dhK2) // their products wrap, as in C
	n := len(b) / 8
	for ; n >= 4; n -= 4 {
		w := b[:32:32]
		w0, w1 := binary.LittleEndian.Uint64(w), binary.LittleEndian.Uint64(w[8:])
		w2, w3 := binary.LittleEndian.Uint64(w[16:]), binary.LittleEndian.Uint64(w[24:])
		a0 += fmix1(w0 ^ k1)
		a1 += fmix1(w1 ^ (k1 + m1))
		a2 += fmix1(w2 ^ (k1 + 2*m1))
		a3 += fmix1(w3 ^ (k1 + 3*m1))
		c0 += fmix2((w0 + k2) ^ key)
		c1 += fmix2((w1 + k2 + m2) ^ key)
		c2 += fmix2((w2 + k2 + 2*m2) ^ key)
		c3 += fmix2((w3 + k2 + 3*m2) ^ key)
		k1 += 4 * m1
		k2 += 4 * m2
		b = b[32:]
	}
	for ; n > 0; n-- {
		w := binary.LittleEndian.Uint64(b)
		a0 += fmix1(w ^ k1)
		c0 += fmix2((w + k2) ^ key)
		k1 += dhK1
		k2 += dhK2
		b = b[8:]
	}
	return blockHash{a0 + a1 + a2 + a3, c0 + c1 + c2 + c3}
}

// fmix1 is MurmurHash3's 64-bit finalizer (devhash.h dh_fmix1).
func fmix1(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xFF51AFD7ED558CCD
	x ^= x >> 33
	x *= 0xC4CEB9FE1A85EC53
	return x ^ x>>33
}

// fmix2 is SplitMix64's (devhash.h dh_fmix2).
func fmix2(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xBF58476D1CE4E5B9
	x ^= x >> 27
	x *= 0x94D049BB133111EB
	return x ^ x>>31
}

// magicHashes starts a BlockHashes file.
const magicHashes = "GPUCRBH1"

// BlockHashes is a process's VRAM files by block: every piece of device
// memory they hold, where its stored blocks are and each one's hash. The
// file (little-endian u64s):
//
//	"GPUCRBH1", KEY (the hashes'), FILES (the process's VRAM files, in the
//	manifest's order), PIECES, then PIECES pieces in address order: FILE
//	(0..FILES-1), VA, SIZE, BLOCK, DATA (where in that file its stored
//	blocks begin), the bitmap of its VRAM record (bit set: not stored)
//	padded with zeros to 8 bytes, then 16 bytes (two lanes) a stored
//	block, in block order; nothing after.
type BlockHashes struct {
	Key    uint64
	Files  int
	pieces []hashedPiece // by address
}

// hashedPiece is one piece of a VRAM file: its record and its stored
// blocks' hashes.
type hashedPiece struct {
	file                  int
	va, size, block, data uint64
	unstored              []byte // the record's bitmap, ceil(nblk/8) bytes
	hashes                []blockHash
}

func (p *hashedPiece) nblk() uint64 { return (p.size + p.block - 1) / p.block }

// stored says whether block b is in the file.
func (p *hashedPiece) stored(b uint64) bool { return p.unstored[b/8]>>(b%8)&1 == 0 }

// blockLen is block b's length.
func (p *hashedPiece) blockLen(b uint64) uint64 { return min(p.block, p.size-b*p.block) }

// ordinal is how many stored blocks come before block b: its place among
// the hashes and, times the block size, its offset from data (only the
// last block of a piece is short).
func (p *hashedPiece) ordinal(b uint64) uint64 {
	n := uint64(0)
	for i := uint64(0); i < b/8; i++ {
		n += uint64(8 - bits.OnesCount8(p.unstored[i]))
	}
	if r := b % 8; r > 0 {
		n += r - uint64(bits.OnesCount8(p.unstored[b/8]&(1<<r-1)))
	}
	return n
}

// storedBytes are the bytes of its stored blocks.
func (p *hashedPiece) storedBytes() uint64 {
	var n uint64
	for b := uint64(0); b < p.nblk(); b++ {
		if p.stored(b) {
			n += p.blockLen(b)
		}
	}
	return n
}

// find is the piece at va, or nil.
func (h *BlockHashes) find(va uint64) *hashedPiece {
	i := sort.Search(len(h.pieces), func(i int) bool { return h.pieces[i].va >= va })
	if i < len(h.pieces) && h.pieces[i].va == va {
		return &h.pieces[i]
	}
	return nil
}

// Bytes are the stored bytes it describes.
func (h *BlockHashes) Bytes() int64 {
	var n uint64
	for i := range h.pieces {
		n += h.pieces[i].storedBytes()
	}
	return int64(n)
}

// newBlockHashes gathers the pieces the files of a process hold (each
// file's composer records its own) into one record.
func newBlockHashes(key uint64, files int, perFile [][]hashedPiece) *BlockHashes {
	h := &BlockHashes{Key: key, Files: files}
	for _, ps := range perFile {
		h.pieces = append(h.pieces, ps...)
	}
	slices.SortFunc(h.pieces, func(a, b hashedPiece) int { return cmp.Compare(a.va, b.va) })
	return h
}

// MarshalBinary writes the file.
func (h *BlockHashes) MarshalBinary() ([]byte, error) {
	var b bytes.Buffer
	b.WriteString(magicHashes)
	put := func(v uint64) { b.Write(binary.LittleEndian.AppendUint64(nil, v)) }
	put(h.Key)
	put(uint64(h.Files))
	put(uint64(len(h.pieces)))
	for i := range h.pieces {
		p := &h.pieces[i]
		for _, v := range []uint64{uint64(p.file), p.va, p.size, p.block, p.data} {
			put(v)
		}
		b.Write(p.unstored)
		b.Write(make([]byte, pad8(len(p.unstored))))
		for _, x := range p.hashes {
			put(x[0])
			put(x[1])
		}
	}
	return b.Bytes(), nil
}

func pad8(n int) int { return (8 - n%8) % 8 }

// ParseBlockHashes reads a BlockHashes file: untrusted bytes (a checkpoint
// from anywhere). Every count is checked against what is left before it
// is believed; pieces must be in address order and apart.
func ParseBlockHashes(b []byte) (*BlockHashes, error) {
	d := decoder{b: b}
	if len(b) < 32 || string(b[:8]) != magicHashes {
		return nil, fmt.Errorf("%w: block hashes: no %s header", ErrVRAMFile, magicHashes)
	}
	d.off = 8
	h := &BlockHashes{Key: d.u64()}
	files, n := d.u64(), d.u64()
	if files == 0 || files > 64 || n > uint64(len(b))/48 {
		return nil, d.bad("%d files, %d pieces", files, n)
	}
	h.Files = int(files)
	h.pieces = make([]hashedPiece, 0, n)
	for range n {
		p, err := d.piece(files)
		if err != nil {
			return nil, err
		}
		if k := len(h.pieces); k > 0 && h.pieces[k-1].va+h.pieces[k-1].size > p.va {
			return nil, d.bad("piece %#x overlaps the one before or is out of order", p.va)
		}
		h.pieces = append(h.pieces, p)
	}
	if d.off != len(b) {
		return nil, d.bad("%d bytes after the last piece", len(b)-d.off)
	}
	return h, nil
}

// decoder reads little-endian words of an untrusted file; bad names the
// offset.
type decoder struct {
	b   []byte
	off int
	err bool
}

// u64 is the next word, or 0 past the end (then err is set).
func (d *decoder) u64() uint64 {
	if len(d.b)-d.off < 8 {
		d.err = true
		return 0
	}
	v := binary.LittleEndian.Uint64(d.b[d.off:])
	d.off += 8
	return v
}

// take is the next n bytes, or nil past the end.
func (d *decoder) take(n uint64) []byte {
	if uint64(len(d.b)-d.off) < n {
		d.err = true
		return nil
	}
	v := d.b[d.off : d.off+int(n)]
	d.off += int(n)
	return v
}

func (d *decoder) bad(format string, args ...any) error {
	return fmt.Errorf("%w: block hashes: offset %d: %s", ErrVRAMFile, d.off, fmt.Sprintf(format, args...))
}

// piece reads one piece of a BlockHashes file.
func (d *decoder) piece(files uint64) (hashedPiece, error) {
	var p hashedPiece
	f, va, size, block, data := d.u64(), d.u64(), d.u64(), d.u64(), d.u64()
	switch {
	case d.err:
		return p, d.bad("truncated")
	case f >= files:
		return p, d.bad("file %d of %d", f, files)
	case va == 0 || size == 0 || size > maxPiece || va+size < va:
		return p, d.bad("range %#x+%d is no piece of device memory", va, size)
	case block < align || block%align != 0 || block > 1<<30:
		return p, d.bad("range %#x: block size %d", va, block)
	case data > 1<<62:
		return p, d.bad("range %#x: data at %d", va, data)
	}
	p = hashedPiece{file: int(f), va: va, size: size, block: block, data: data}
	nb := int(p.nblk()+7) / 8
	p.unstored = d.take(uint64(nb))
	padding := d.take(uint64(pad8(nb)))
	if d.err {
		return p, d.bad("truncated in the bitmap of %#x", va)
	}
	for _, c := range padding {
		if c != 0 {
			return p, d.bad("range %#x: padding is not zero", va)
		}
	}
	for bit := p.nblk(); bit < uint64(nb)*8; bit++ {
		if p.unstored[bit/8]>>(bit%8)&1 != 0 {
			return p, d.bad("range %#x: the bitmap marks block %d of %d", va, bit, p.nblk())
		}
	}
	k := p.ordinal(p.nblk())
	raw := d.take(16 * k)
	if d.err {
		return p, d.bad("range %#x: %d hashes wanted", va, k)
	}
	p.hashes = make([]blockHash, k)
	for i := range p.hashes {
		p.hashes[i] = blockHash{binary.LittleEndian.Uint64(raw[16*i:]), binary.LittleEndian.Uint64(raw[16*i+8:])}
	}
	p.unstored = slices.Clone(p.unstored)
	return p, nil
}

// CheckFiles checks h against the sizes of the files it describes: every
// piece's stored bytes lie in its file, and no two pieces' overlap.
func (h *BlockHashes) CheckFiles(sizes []int64) error {
	if len(sizes) != h.Files {
		return fmt.Errorf("%w: block hashes of %d files, the checkpoint has %d", ErrVRAMFile, h.Files, len(sizes))
	}
	type span struct{ lo, hi uint64 }
	spans := make([][]span, h.Files)
	for i := range h.pieces {
		p := &h.pieces[i]
		end := p.data + p.storedBytes()
		if end > uint64(sizes[p.file]) {
			return fmt.Errorf("%w: block hashes: range %#x ends at %d of file %d, which has %d bytes", ErrVRAMFile, p.va, end, p.file, sizes[p.file])
		}
		spans[p.file] = append(spans[p.file], span{p.data, end})
	}
	for f, ss := range spans {
		slices.SortFunc(ss, func(a, b span) int { return cmp.Compare(a.lo, b.lo) })
		for i := 1; i < len(ss); i++ {
			if ss[i].lo < ss[i-1].hi {
				return fmt.Errorf("%w: block hashes: two pieces overlap in file %d at %d", ErrVRAMFile, f, ss[i].lo)
			}
		}
	}
	return nil
}
