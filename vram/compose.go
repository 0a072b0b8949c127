package vram

// Composing whole VRAM files from a kept copy that left out the blocks an
// earlier checkpoint holds (unchanged.go): the kept file's bytes, each
// hole filled with that checkpoint's bytes of the block, which must hash
// to what its record says before it is written (never garbage: a block
// that does not is an error): the library's copy in of an undo or of `gpu
// resume --pid`. (The store cuts the files instead: storecut.go.) Every
// stored block is hashed on the way.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/fsat"
	"github.com/gpucr/gpucr-stream/manifest"
)

// Earlier is an earlier --dedup checkpoint of a process, in the location
// a new one goes to (gpuckpt finds it): its record of its VRAM files by
// block, and a reader of them.
type Earlier struct {
	// Name says where it is (LOC/NAME): for messages, and for the record
	// of a kept copy that leaves its blocks out (`gpu resume --pid`
	// opens it again).
	Name   string
	Hashes *BlockHashes
	// Files are its VRAM files of the process (the Hashes' files).
	Files []string
	// Open reads one of them at any offset; a reader is used by one
	// goroutine at a time.
	Open func(ctx context.Context, name string) (io.ReaderAt, error)
	// Chunks are the Files' chunks as its manifest lists them, where the
	// new checkpoint may name them (not encrypted): a group of blocks
	// that did not change is stored by them where they are its bytes
	// alone (storecut.go).
	Chunks [][]manifest.Chunk
}

// reader is a reader of its file i, opened once: readers keeps those
// opened, for one goroutine.
func (e *Earlier) reader(ctx context.Context, readers map[int]io.ReaderAt, i int) (io.ReaderAt, error) {
	if r, ok := readers[i]; ok {
		return r, nil
	}
	r, err := e.Open(ctx, e.Files[i])
	if err != nil {
		return nil, fmt.Errorf("the earlier checkpoint %s: %w", e.Name, err)
	}
	readers[i] = r
	return r, nil
}

// keptReader reads a kept file (size bytes): the library's format 3
// (its magic checked), the only one a copy out writes.
func keptReader(kept io.ReaderAt, size int64) (*fileReader, error) {
	fr := &fileReader{r: kept, size: size}
	magic := make([]byte, 8)
	if err := fr.read(0, magic); err != nil {
		return nil, err
	}
	if string(magic) != magicV3 {
		return nil, fr.bad(0, "magic %q, not the library's %s", magic, magicV3)
	}
	fr.version = 3
	return fr, nil
}

// piece is rec, just read, as the piece of kept file k, its bitmap
// copied and no hashes yet.
func (fr *fileReader) piece(k int, rec record) *hashedPiece {
	p := &hashedPiece{file: k, va: rec.va, size: rec.size, block: rec.block, data: uint64(rec.start)}
	p.unstored = append([]byte(nil), fr.bm[:(p.nblk()+7)/8]...)
	return p
}

// copyBuf is what a composer reads at once: runs of blocks up to it.
const copyBuf = 4 << 20

// readRun reads the stored blocks b..b+n-1 of hp (consecutive in its
// file, and in buf's room) from r, and checks each against its hash.
func (e *Earlier) readRun(r io.ReaderAt, hp *hashedPiece, b, n uint64, buf []byte) ([]byte, error) {
	first := hp.ordinal(b)
	var length uint64
	for i := b; i < b+n; i++ {
		length += hp.blockLen(i)
	}
	buf = buf[:length]
	if _, err := r.ReadAt(buf, int64(hp.data+first*hp.block)); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("the earlier checkpoint %s: %s at %#x: %w", e.Name, e.Files[hp.file], hp.va+b*hp.block, err)
	} else if err != nil {
		return nil, fmt.Errorf("the earlier checkpoint %s: %s ends before the block at %#x: %w", e.Name, e.Files[hp.file], hp.va+b*hp.block, errdefs.ErrCorrupt)
	}
	for i, at := uint64(0), uint64(0); i < n; i++ {
		l := hp.blockLen(b + i)
		if hashBlock(buf[at:at+l], e.Hashes.Key) != hp.hashes[first+i] {
			return nil, fmt.Errorf("the earlier checkpoint %s: the block at %#x of %s is not what its record says (damaged, or not this memory): %w",
				e.Name, hp.va+(b+i)*hp.block, e.Files[hp.file], errdefs.ErrCorrupt)
		}
		at += l
	}
	return buf, nil
}

// composer makes one process's VRAM files whole again from its kept
// copy: key hashes what it reads from the kept copy; the blocks skip has
// come from earlier.
type composer struct {
	key     uint64
	skip    *skipSet
	earlier *Earlier
}

// compose writes the kept file k (kept, size bytes) into w with its holes
// filled, and returns its pieces with every stored block's hash.
func (c *composer) compose(ctx context.Context, k int, kept io.ReaderAt, size int64, w io.Writer) ([]hashedPiece, error) {
	fr, err := keptReader(kept, size)
	if err != nil {
		return nil, err
	}
	if _, err := w.Write([]byte(magicV3)); err != nil {
		return nil, err
	}
	var out []hashedPiece
	readers := map[int]io.ReaderAt{}
	var buf []byte
	for off := int64(8); ; {
		rec, next, end, err := fr.record(off)
		if err != nil {
			return nil, err
		}
		if end {
			_, err := w.Write(make([]byte, 32))
			return out, err
		}
		// The header, bitmap and padding as the library wrote them (and
		// the record checked).
		p := fr.piece(k, rec)
		head := append(append(fr.hdr, p.unstored...), make([]byte, rec.start-off-int64(len(fr.hdr)+len(p.unstored)))...)
		if _, err := w.Write(head); err != nil {
			return nil, err
		}
		// Runs of up to copyBuf, and a block over it whole (at most a
		// piece); no more than the piece's data.
		if n := int(max(min(copyBuf, rec.data), int64(min(p.block, p.size)))); len(buf) < n {
			buf = make([]byte, n)
		}
		if err := c.blocks(ctx, p, kept, w, buf, readers); err != nil {
			return nil, err
		}
		out = append(out, *p)
		off = next
	}
}

// blocks writes p's stored blocks into w, in runs of blocks from one
// place (the kept file, or the earlier checkpoint's), each block hashed.
func (c *composer) blocks(ctx context.Context, p *hashedPiece, kept io.ReaderAt, w io.Writer, buf []byte, readers map[int]io.ReaderAt) error {
	from := func(b uint64) bool { return c.skip.has(p.va + b*p.block) }
	per := max(1, uint64(len(buf))/p.block)
	var hp *hashedPiece
	at := p.data // in the kept file
	for b := uint64(0); b < p.nblk(); {
		if !p.stored(b) {
			b++
			continue
		}
		early, n := from(b), uint64(1)
		for n < per && b+n < p.nblk() && p.stored(b+n) && from(b+n) == early {
			n++
		}
		if err := ctx.Err(); err != nil {
			return context.Cause(ctx)
		}
		var run []byte
		var err error
		if early {
			run, hp, err = c.fromEarlier(ctx, p, hp, b, n, buf, readers)
		} else {
			run, err = c.fromKept(kept, p, b, n, at, buf)
		}
		if err != nil {
			return err
		}
		if _, err := w.Write(run); err != nil {
			return err
		}
		at += uint64(len(run))
		b += n
	}
	return nil
}

// fromKept reads the blocks b..b+n-1 of p from the kept file at at and
// hashes them into p.
func (c *composer) fromKept(kept io.ReaderAt, p *hashedPiece, b, n, at uint64, buf []byte) ([]byte, error) {
	var length uint64
	for i := b; i < b+n; i++ {
		length += p.blockLen(i)
	}
	run := buf[:length]
	if _, err := kept.ReadAt(run, int64(at)); err != nil {
		return nil, fmt.Errorf("kept copy: the block at %#x: %w", p.va+b*p.block, err)
	}
	for i, o := uint64(0), uint64(0); i < n; i++ {
		l := p.blockLen(b + i)
		p.hashes = append(p.hashes, hashBlock(run[o:o+l], c.key))
		o += l
	}
	return run, nil
}

// fromEarlier reads the blocks b..b+n-1 of p from the earlier checkpoint
// (hp: its piece at p's address, found once), checked against its
// record, whose hashes p takes.
func (c *composer) fromEarlier(ctx context.Context, p, hp *hashedPiece, b, n uint64, buf []byte, readers map[int]io.ReaderAt) ([]byte, *hashedPiece, error) {
	e := c.earlier
	if hp == nil {
		if e == nil {
			return nil, nil, fmt.Errorf("the block at %#x was left out for an earlier checkpoint, and none is given", p.va+b*p.block)
		}
		if hp = e.Hashes.find(p.va); hp == nil || hp.size != p.size || hp.block != p.block {
			return nil, nil, fmt.Errorf("the earlier checkpoint %s holds no piece %#x+%d in blocks of %d: %w", e.Name, p.va, p.size, p.block, errdefs.ErrCorrupt)
		}
	}
	for i := b; i < b+n; i++ {
		if !hp.stored(i) {
			return nil, nil, fmt.Errorf("the earlier checkpoint %s does not store the block at %#x: %w", e.Name, p.va+i*p.block, errdefs.ErrCorrupt)
		}
	}
	r, err := e.reader(ctx, readers, hp.file)
	if err != nil {
		return nil, nil, err
	}
	run, err := e.readRun(r, hp, b, n, buf)
	if err != nil {
		return nil, nil, err
	}
	first := hp.ordinal(b)
	p.hashes = append(p.hashes, hp.hashes[first:first+n]...)
	return run, hp, nil
}

// composedPipes starts composing the kept files names (ids, in dir) into
// pipes: their read ends, for the library's copy in, and a wait that
// returns once every composer has ended (the read ends closed first, by
// the caller, ends those still writing).
func composedPipes(ctx context.Context, c *composer, dir *os.File, names []string, ids []fsat.ID) ([]*os.File, func() error, error) {
	kept, err := openFiles(dir, names, ids)
	if err != nil {
		return nil, nil, err
	}
	var reads []*os.File
	errs := make([]error, len(kept))
	var wg sync.WaitGroup
	for k, f := range kept {
		r, w, err := os.Pipe()
		if err != nil {
			closeAll(reads)
			errs[k] = err
			break
		}
		reads = append(reads, r)
		wg.Go(func() {
			defer f.Close()
			defer w.Close()
			st, err := f.Stat()
			if err == nil {
				_, err = c.compose(ctx, k, f, st.Size(), w)
			}
			errs[k] = err
		})
	}
	wait := func() error {
		wg.Wait()
		for _, f := range kept[len(reads):] {
			f.Close()
		}
		return errors.Join(errs...)
	}
	if len(reads) < len(kept) {
		return nil, nil, wait()
	}
	return reads, wait, nil
}
