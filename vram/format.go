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
	fr := &fileReader{r: r, size: size}
	var st FileStats
	magic := make([]byte, 8)
	if err := fr.read(0, magic); err != nil {
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
		return st, fr.bad(0, "magic %q", magic)
	}
	fr.version = st.Version
	for off := int64(8); ; {
		rec, next, end, err := fr.record(off)
		if err != nil || end {
			return st, err
		}
		off = next
		st.Pieces++
		st.Allocated += int64(rec.size)
		st.Cached += int64(rec.cached)
		st.Data += rec.data
		st.Written += rec.data + int64(rec.cached)
	}
}

// fileReader reads one VRAM file's headers, every length checked against
// the file's size first.
type fileReader struct {
	r       io.ReaderAt
	size    int64
	version int
	hdr, bm []byte
}

// record is one piece's header as a file describes it.
type record struct {
	va, size, block, cached uint64
	data                    int64 // the bytes of it the file holds
	start                   int64 // where in the file they begin
}

func (fr *fileReader) bad(off int64, format string, args ...any) error {
	return fmt.Errorf("%w: offset %d: %s", ErrVRAMFile, off, fmt.Sprintf(format, args...))
}

func (fr *fileReader) read(off int64, b []byte) error {
	if off > fr.size || int64(len(b)) > fr.size-off {
		return fr.bad(off, "truncated (%d bytes wanted, the file has %d)", len(b), fr.size)
	}
	if _, err := fr.r.ReadAt(b, off); err != nil && !(errors.Is(err, io.EOF) && off+int64(len(b)) == fr.size) {
		return fmt.Errorf("read at %d: %w", off, err)
	}
	return nil
}

// record reads the record at off (header, bitmap, padding, and skips its
// data): the record, where the next begins, or end at the end record.
func (fr *fileReader) record(off int64) (rec record, next int64, end bool, err error) {
	hn := int64(16)
	if fr.version == 3 {
		hn = 32
	}
	if fr.hdr == nil {
		fr.hdr, fr.bm = make([]byte, hn), make([]byte, maxPiece/align/8)
	}
	hdr := fr.hdr
	if err := fr.read(off, hdr); err != nil {
		return rec, 0, false, err
	}
	at := off
	off += hn
	rec.va, rec.size = binary.LittleEndian.Uint64(hdr), binary.LittleEndian.Uint64(hdr[8:])
	rec.block = rec.size
	if fr.version == 3 {
		rec.block, rec.cached = binary.LittleEndian.Uint64(hdr[16:]), binary.LittleEndian.Uint64(hdr[24:])
	}
	if bytes.Equal(hdr, make([]byte, hn)) {
		if off != fr.size {
			return rec, 0, false, fr.bad(off, "%d bytes after the end record", fr.size-off)
		}
		return rec, off, true, nil
	}
	if rec.va == 0 || rec.size == 0 || rec.size > maxPiece || rec.va+rec.size < rec.va {
		return rec, 0, false, fr.bad(at, "range %#x+%d is no piece of device memory", rec.va, rec.size)
	}
	if fr.version == 3 && (rec.block < align || rec.block%align != 0 || rec.block > 1<<30) {
		return rec, 0, false, fr.bad(at, "range %#x: block size %d is not a multiple of 4096 up to 1 GiB", rec.va, rec.block)
	}
	unstored, off, err := fr.bitmap(rec, off)
	if err != nil {
		return rec, 0, false, err
	}
	if rec.cached > unstored {
		return rec, 0, false, fr.bad(at, "range %#x: %d bytes cached, more than the %d not stored", rec.va, rec.cached, unstored)
	}
	if off, err = fr.padding(rec, off); err != nil {
		return rec, 0, false, err
	}
	rec.data, rec.start = int64(rec.size-unstored), off
	if rec.data > fr.size-off {
		return rec, 0, false, fr.bad(off, "range %#x: %d bytes of data, the file has %d left", rec.va, rec.data, fr.size-off)
	}
	return rec, off + rec.data, false, nil
}

// bitmap reads rec's bitmap of blocks not stored (version 3) at off: the
// bytes they cover, and where the bitmap ends.
func (fr *fileReader) bitmap(rec record, off int64) (unstored uint64, end int64, err error) {
	if fr.version < 3 {
		return 0, off, nil
	}
	nblk := (rec.size + rec.block - 1) / rec.block
	bl := int64((nblk + 7) / 8)
	bm := fr.bm[:bl]
	if err := fr.read(off, bm); err != nil {
		return 0, 0, err
	}
	for b := uint64(0); b < uint64(bl)*8; b++ {
		if bm[b/8]&(1<<(b%8)) == 0 {
			continue
		}
		if b >= nblk {
			return 0, 0, fr.bad(off, "range %#x: the bitmap marks block %d of %d", rec.va, b, nblk)
		}
		unstored += min(rec.block, rec.size-b*rec.block)
	}
	return unstored, off + bl, nil
}

// padding checks the zeros up to the next 4 KiB boundary before rec's data
// (versions 2 and 3), and says where the data begins.
func (fr *fileReader) padding(rec record, off int64) (int64, error) {
	p := off % align
	if fr.version == 1 || p == 0 {
		return off, nil
	}
	pad := make([]byte, align-p)
	if err := fr.read(off, pad); err != nil {
		return 0, err
	}
	for i, c := range pad {
		if c != 0 {
			return 0, fr.bad(off+int64(i), "padding before range %#x is not zero", rec.va)
		}
	}
	return off + int64(len(pad)), nil
}
