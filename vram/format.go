package vram

// The VRAM files' format as gpucr-stream reads it (docs/PRODUCERS.md, "VRAM
// files"; the library writes and reads it in preload/copy.c): what a file
// holds of the device memory, from its headers alone, for inspect. The
// bytes are untrusted (a checkpoint from anywhere): every length is
// checked against the file's size before it is believed, and nothing is
// held but one record's header and bitmap.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/gpucr/gpucr-stream/errdefs"
)

// The format's constants (preload/copy.c).
const (
	magicV3 = "GPUCRVM3" // stored blocks only, a bitmap of the others
	magicV2 = "GPUCRVM2" // every byte, each piece at a 4 KiB boundary
	magicV1 = "GPUCRVM1" // every byte, right after its header
	// maxPiece is the largest piece the library writes.
	maxPiece = 64 << 20
	align    = 4096
)

// FileStats is what one VRAM file holds of the device memory.
type FileStats struct {
	// Version is the format's (1, 2 or 3); Pieces its records.
	Version int `json:"version"`
	Pieces  int `json:"pieces"`
	// Allocated is the device memory its pieces cover; Written, the part
	// that was not all zero (a version 3 file says; before, all of it);
	// Cached, the part of that left out as a cache the program marked;
	// Data, the device memory's bytes the file holds (Written - Cached).
	Allocated int64 `json:"allocated"`
	Written   int64 `json:"written"`
	Cached    int64 `json:"cached"`
	Data      int64 `json:"data"`
}

// ErrVRAMFile says a VRAM file is not in the format.
var ErrVRAMFile = fmt.Errorf("not a well-formed VRAM file: %w", errdefs.ErrCorrupt)

// ReadFileStats reads the headers of the VRAM file r (size bytes), skipping
// the device memory's bytes.
func ReadFileStats(r io.ReaderAt, size int64) (FileStats, error) {
	var st FileStats
	bad := func(off int64, format string, args ...any) error {
		return fmt.Errorf("%w: offset %d: %s", ErrVRAMFile, off, fmt.Sprintf(format, args...))
	}
	read := func(off int64, b []byte) error {
		if off > size || int64(len(b)) > size-off {
			return bad(off, "truncated (%d bytes wanted, the file has %d)", len(b), size)
		}
		if _, err := r.ReadAt(b, off); err != nil && !(errors.Is(err, io.EOF) && off+int64(len(b)) == size) {
			return fmt.Errorf("read at %d: %w", off, err)
		}
		return nil
	}
	magic := make([]byte, 8)
	if err := read(0, magic); err != nil {
		return st, err
	}
	switch string(magic) {
	case magicV3:
		st.Version = 3
	case magicV2:
		st.Version = 2
	case magicV1:
		st.Version = 1
	default:
		return st, bad(0, "magic %q", magic)
	}
	hn := int64(16)
	if st.Version == 3 {
		hn = 32
	}
	hdr := make([]byte, hn)
	bm := make([]byte, maxPiece/align/8)
	pad := make([]byte, align)
	for off := int64(8); ; {
		if err := read(off, hdr); err != nil {
			return st, err
		}
		at := off
		off += hn
		va, n := binary.LittleEndian.Uint64(hdr), binary.LittleEndian.Uint64(hdr[8:])
		block, cached := n, uint64(0)
		if st.Version == 3 {
			block, cached = binary.LittleEndian.Uint64(hdr[16:]), binary.LittleEndian.Uint64(hdr[24:])
		}
		if bytes.Equal(hdr, make([]byte, hn)) {
			if off != size {
				return st, bad(off, "%d bytes after the end record", size-off)
			}
			return st, nil
		}
		if va == 0 || n == 0 || n > maxPiece || va+n < va {
			return st, bad(at, "range %#x+%d is no piece of device memory", va, n)
		}
		if st.Version == 3 && (block < align || block%align != 0 || block > 1<<30) {
			return st, bad(at, "range %#x: block size %d is not a multiple of 4096 up to 1 GiB", va, block)
		}
		nblk := (n + block - 1) / block
		bl := int64((nblk + 7) / 8)
		if st.Version < 3 {
			bl = 0
		}
		if err := read(off, bm[:bl]); err != nil {
			return st, err
		}
		off += bl
		var unstored uint64
		for b := uint64(0); b < uint64(bl)*8; b++ {
			if bm[b/8]&(1<<(b%8)) == 0 {
				continue
			}
			if b >= nblk {
				return st, bad(off-bl, "range %#x: the bitmap marks block %d of %d", va, b, nblk)
			}
			unstored += min(block, n-b*block)
		}
		if cached > unstored {
			return st, bad(at, "range %#x: %d bytes cached, more than the %d not stored", va, cached, unstored)
		}
		if p := off % align; st.Version > 1 && p != 0 {
			if err := read(off, pad[:align-p]); err != nil {
				return st, err
			}
			for i, c := range pad[:align-p] {
				if c != 0 {
					return st, bad(off+int64(i), "padding before range %#x is not zero", va)
				}
			}
			off += align - p
		}
		data := int64(n - unstored)
		if data > size-off {
			return st, bad(off, "range %#x: %d bytes of data, the file has %d left", va, data, size-off)
		}
		off += data
		st.Pieces++
		st.Allocated += int64(n)
		st.Cached += int64(cached)
		st.Data += data
		st.Written += data + int64(cached)
	}
}
