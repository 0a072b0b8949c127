package vram

// Which blocks did not change since an earlier checkpoint: the library
// hashes every block on the device (`hashes`, preload/dedup.c) into a
// file, gpucr-stream compares those hashes with the earlier checkpoint's
// own record of its blocks (BlockHashes), and hands the library the
// blocks to leave out of the copy out (`skip`) in a skip file. Both files
// are little-endian u64s; what the library writes is untrusted (the
// process's user may have it write anything), and so is a skip file read
// back from the kept copy's directory by a later run (`gpu resume --pid`).

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/bits"
	"sort"
)

const (
	magicDevHashes = "GPUCRDH1"
	magicSkip      = "GPUCRSK1"
)

// deviceHashes is what `hashes` wrote: "GPUCRDH1", KEY, BLOCK, M, then M
// mappings in address order: VA, SIZE, a bitmap of its blocks (bit set:
// the library offers to leave it out: stored now, and in no marked range)
// padded with zeros to 8 bytes, then 16 bytes a block.
type deviceHashes struct {
	key, block uint64
	maps       []devMap
}

type devMap struct {
	va, size uint64
	bits     []byte // offered (deviceHashes) or left out (skip file)
	hashes   []blockHash
}

func (m *devMap) nblk(block uint64) uint64 { return (m.size + block - 1) / block }

func (m *devMap) has(b uint64) bool { return m.bits[b/8]>>(b%8)&1 != 0 }

// parseDeviceHashes reads what `hashes` wrote into a file of len(b) bytes.
// The block must be a power of two that divides a piece, as the library's
// zero blocks are (preload/written.c), or no block is comparable.
func parseDeviceHashes(b []byte) (*deviceHashes, error) {
	d := decoder{b: b}
	if len(b) < 32 || string(b[:8]) != magicDevHashes {
		return nil, fmt.Errorf("%w: device hashes: no %s header", ErrVRAMFile, magicDevHashes)
	}
	d.off = 8
	h := &deviceHashes{key: d.u64(), block: d.u64()}
	n := d.u64()
	if h.block < align || h.block > maxPiece || bits.OnesCount64(h.block) != 1 || n > uint64(len(b))/24 {
		return nil, d.bad("block %d, %d mappings", h.block, n)
	}
	maps, err := d.maps(n, h.block, true)
	if err != nil {
		return nil, err
	}
	h.maps = maps
	return h, nil
}

// maps reads n mappings of a device hashes file (withHashes) or of a skip
// file: each with its bitmap padded to 8 bytes, in address order and
// apart; nothing after them.
func (d *decoder) maps(n, block uint64, withHashes bool) ([]devMap, error) {
	var out []devMap
	for range n {
		va, size := d.u64(), d.u64()
		if !withHashes && !d.err && d.u64() != block {
			return nil, d.bad("mapping %#x: not in blocks of %d", va, block)
		}
		if d.err || va == 0 || size == 0 || size%8 != 0 || va+size < va || size > 1<<50 {
			return nil, d.bad("mapping %#x+%d", va, size)
		}
		if k := len(out); k > 0 && out[k-1].va+out[k-1].size > va {
			return nil, d.bad("mapping %#x overlaps the one before or is out of order", va)
		}
		m := devMap{va: va, size: size}
		nblk := m.nblk(block)
		nb := (nblk + 63) / 64 * 8
		m.bits = bytes.Clone(d.take(nb))
		if d.err {
			return nil, d.bad("mapping %#x: truncated in its bitmap", va)
		}
		for bit := nblk; bit < nb*8; bit++ {
			if m.has(bit) {
				return nil, d.bad("mapping %#x: the bitmap marks block %d of %d", va, bit, nblk)
			}
		}
		if withHashes {
			raw := d.take(16 * nblk)
			if d.err {
				return nil, d.bad("mapping %#x: truncated in its hashes", va)
			}
			m.hashes = make([]blockHash, nblk)
			for i := range m.hashes {
				m.hashes[i] = blockHash{binary.LittleEndian.Uint64(raw[16*i:]), binary.LittleEndian.Uint64(raw[16*i+8:])}
			}
		}
		out = append(out, m)
	}
	if d.off != len(d.b) {
		return nil, d.bad("%d bytes after the last mapping", len(d.b)-d.off)
	}
	return out, nil
}

// skipSet is the blocks a copy out left out (a skip file): by mapping, in
// the library's zero blocks.
type skipSet struct {
	block uint64
	maps  []devMap // bits: left out
	bytes int64
}

// has says whether the block at device address va was left out.
func (s *skipSet) has(va uint64) bool {
	if s == nil {
		return false
	}
	i := sort.Search(len(s.maps), func(i int) bool { return s.maps[i].va+s.maps[i].size > va })
	if i == len(s.maps) || s.maps[i].va > va {
		return false
	}
	return s.maps[i].has((va - s.maps[i].va) / s.block)
}

// unchanged is the skip set of the blocks the library offered whose
// device hash equals the hash e recorded for the block it stored at that
// address, in a piece of the same address, size and block size (the
// mapping is the one e's process had). nil when there are none.
func unchanged(dev *deviceHashes, e *BlockHashes) *skipSet {
	if dev.key != e.Key {
		return nil
	}
	s := &skipSet{block: dev.block}
	for _, m := range dev.maps {
		left := devMap{va: m.va, size: m.size, bits: make([]byte, len(m.bits))}
		any := false
		for ps := m.va; ps < m.va+m.size; ps += maxPiece {
			hp := e.find(ps)
			if hp == nil || hp.size != min(maxPiece, m.va+m.size-ps) || hp.block != dev.block {
				continue
			}
			first, ord := (ps-m.va)/dev.block, uint64(0) // ord: hp.ordinal(b)
			for b := uint64(0); b < hp.nblk(); b++ {
				mb := first + b
				if !hp.stored(b) {
					continue
				}
				ord++
				if !m.has(mb) {
					continue
				}
				if h := hp.hashes[ord-1]; h != (blockHash{}) && h == m.hashes[mb] {
					left.bits[mb/8] |= 1 << (mb % 8)
					s.bytes += int64(hp.blockLen(b))
					any = true
				}
			}
		}
		if any {
			s.maps = append(s.maps, left)
		}
	}
	if s.bytes == 0 {
		return nil
	}
	return s
}

// MarshalBinary writes the skip file: "GPUCRSK1", M, then M mappings: VA,
// SIZE, BLOCK, the bitmap (set: left out) padded with zeros to 8 bytes.
func (s *skipSet) MarshalBinary() ([]byte, error) {
	var b bytes.Buffer
	b.WriteString(magicSkip)
	put := func(v uint64) { b.Write(binary.LittleEndian.AppendUint64(nil, v)) }
	put(uint64(len(s.maps)))
	for _, m := range s.maps {
		put(m.va)
		put(m.size)
		put(s.block)
		b.Write(m.bits)
	}
	return b.Bytes(), nil
}

// parseSkip reads a skip file (one a run of gpucr-stream wrote into the
// kept copy's directory, read back by a later one).
func parseSkip(b []byte) (*skipSet, error) {
	d := decoder{b: b}
	if len(b) < 16 || string(b[:8]) != magicSkip {
		return nil, fmt.Errorf("%w: skip file: no %s header", ErrVRAMFile, magicSkip)
	}
	d.off = 8
	n := d.u64()
	if n > uint64(len(b))/32 {
		return nil, d.bad("%d mappings", n)
	}
	var block uint64
	if n > 0 && len(b) >= 40 {
		block = binary.LittleEndian.Uint64(b[32:])
	}
	if n > 0 && (block < align || block > maxPiece || bits.OnesCount64(block) != 1) {
		return nil, d.bad("block %d", block)
	}
	maps, err := d.maps(n, block, false)
	if err != nil {
		return nil, err
	}
	s := &skipSet{block: block, maps: maps}
	for _, m := range maps {
		for b := uint64(0); b < m.nblk(block); b++ {
			if m.has(b) {
				s.bytes += int64(min(block, m.size-b*block))
			}
		}
	}
	return s, nil
}
