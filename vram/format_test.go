package vram

import (
	"bytes"
	"encoding/binary"
	"errors"
	"strings"
	"testing"
)

// vramPiece is one record to write: block 0 for versions 1 and 2.
type vramPiece struct {
	va, n, block, cached uint64
	unstored             []int // blocks not stored
}

// buildVRAM writes a VRAM file of version v as preload/copy.c does (the
// data bytes are 0x5a).
func buildVRAM(v int, ps ...vramPiece) []byte {
	b := []byte("GPUCRVM" + string(rune('0'+v)))
	le := binary.LittleEndian
	for _, p := range ps {
		b = le.AppendUint64(le.AppendUint64(b, p.va), p.n)
		data := p.n
		if v == 3 {
			b = le.AppendUint64(le.AppendUint64(b, p.block), p.cached)
			nblk := (p.n + p.block - 1) / p.block
			bm := make([]byte, (nblk+7)/8)
			for _, k := range p.unstored {
				bm[k/8] |= 1 << (k % 8)
				data -= min(p.block, p.n-uint64(k)*p.block)
			}
			b = append(b, bm...)
		}
		if v > 1 {
			b = append(b, make([]byte, (4096-len(b)%4096)%4096)...)
		}
		b = append(b, bytes.Repeat([]byte{0x5a}, int(data))...)
	}
	return append(b, make([]byte, map[bool]int{true: 32, false: 16}[v == 3])...)
}

func TestReadFileStats(t *testing.T) {
	const blk = 64 << 10
	two := []vramPiece{
		{va: 1 << 40, n: 2 << 20, block: blk, cached: 2 * blk, unstored: []int{0, 5, 6, 31}},
		{va: 1<<40 + 2<<20, n: 3<<20 + 4096, block: blk, unstored: []int{48}}, // the last block short
	}
	good := buildVRAM(3, two...)
	padded := append([]byte{}, good...)
	padded[8+32+4+100] = 1
	for _, tc := range []struct {
		name string
		b    []byte
		want FileStats
		err  string
	}{
		{"version 3", good, FileStats{Version: 3, Pieces: 2, Allocated: 5<<20 + 4096, Written: 5<<20 + 4096 - 2*blk - 4096, Cached: 2 * blk,
			Data: 5<<20 + 4096 - 4*blk - 4096}, ""},
		{"version 2", buildVRAM(2, vramPiece{va: 1 << 40, n: 2 << 20}), FileStats{Version: 2, Pieces: 1, Allocated: 2 << 20, Written: 2 << 20, Data: 2 << 20}, ""},
		{"version 1", buildVRAM(1, vramPiece{va: 1 << 40, n: 8192}), FileStats{Version: 1, Pieces: 1, Allocated: 8192, Written: 8192, Data: 8192}, ""},
		{"empty", buildVRAM(3), FileStats{Version: 3}, ""},
		{"bad magic", []byte("GPUCRVM9"), FileStats{}, "magic"},
		{"no magic", []byte("GPU"), FileStats{}, "truncated"},
		{"no end record", good[:len(good)-32], FileStats{}, "truncated"},
		{"trailing bytes", append(append([]byte{}, good...), 0), FileStats{}, "after the end record"},
		{"block not pages", buildVRAM(3, vramPiece{va: 1 << 40, n: 8192, block: 4097}), FileStats{}, "block size 4097"},
		{"piece too large", buildVRAM(3, vramPiece{va: 1 << 40, n: 128 << 20, block: blk}), FileStats{}, "no piece"},
		{"wraps", buildVRAM(1, vramPiece{va: 1<<64 - 4096, n: 8192})[:40], FileStats{}, "no piece"},
		{"bitmap past the blocks", buildVRAM(3, vramPiece{va: 1 << 40, n: 3 * blk, block: blk, unstored: []int{7}}), FileStats{}, "marks block 7 of 3"},
		{"more cached than left out", buildVRAM(3, vramPiece{va: 1 << 40, n: 3 * blk, block: blk, cached: blk + 1, unstored: []int{1}}), FileStats{}, "more than the"},
		{"padding not zero", padded, FileStats{}, "padding"},
		{"data cut", good[:len(good)-32-4096], FileStats{}, "bytes of data"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ReadFileStats(bytes.NewReader(tc.b), int64(len(tc.b)))
			if tc.err != "" {
				if !errors.Is(err, ErrVRAMFile) || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("%v, want %q", err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("%+v %v, want %+v", got, err, tc.want)
			}
		})
	}
}

// FuzzReadFileStats: the reader of untrusted VRAM files never panics, and
// what it accepts adds up.
func FuzzReadFileStats(f *testing.F) {
	f.Add(buildVRAM(3, vramPiece{va: 1 << 40, n: 1 << 20, block: 64 << 10, cached: 64 << 10, unstored: []int{0, 3}}))
	f.Add(buildVRAM(2, vramPiece{va: 1 << 40, n: 8192}))
	f.Add(buildVRAM(1, vramPiece{va: 1 << 40, n: 4096}))
	f.Add([]byte("GPUCRVM3"))
	f.Fuzz(func(t *testing.T, b []byte) {
		st, err := ReadFileStats(bytes.NewReader(b), int64(len(b)))
		if err != nil {
			return
		}
		if st.Data > int64(len(b)) || st.Written > st.Allocated || st.Data+st.Cached != st.Written || st.Cached < 0 || st.Pieces < 0 {
			t.Fatalf("accepted %d bytes as %+v", len(b), st)
		}
	})
}
