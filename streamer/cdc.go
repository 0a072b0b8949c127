package streamer

// Content-defined chunk boundaries (docs/FORMAT.md section 17.6), for
// every output that deduplicates (a location's chunk store, a migration
// peer's chunk cache): a page inserted or removed near the start of a
// mapping must not make the rest of the image new, which fixed-size
// chunks would (every later boundary moves by a page). Boundaries fall on
// 4 KiB page boundaries of the file, after a page whose CRC-32C meets a
// mask: the decision depends on that page's content alone, so after a
// shift the cuts fall on the same pages again, from the first cut after
// the change. Chunks are at least minChunk and at most the chunk size;
// zero pages never cut, and a chunk that starts in a run of zero pages
// ends where the run does, a zero chunk, which costs no storage.
//
// CRIU's pages images hold whole pages in order, so their content moves by
// whole pages when a mapping grows or shrinks. The page CRC is the SSE4.2
// instruction (tens of GB/s). Each page gets one zero test and one CRC-32C,
// while it is in the cache: they decide the cut, and make the chunk's zero
// test and its CRC-32C, joined from its pages' (codec.ChecksumCombiner)
// without another pass over the bytes.

import (
	"errors"
	"io"
	"math/bits"

	"github.com/gpucr/gpucr-stream/codec"
)

const cdcPage = 4 << 10

// cdcRead is the most one Read asks for once a chunk may end (past its
// minimum): what is read past a cut is copied to the next chunk's buffer
// (twice: out and back), so a read stays short. Before the minimum no cut
// can fall, and one read asks for all of it.
const cdcRead = 64 << 10

// cdcParams are the boundaries' limits for a chunk size of max bytes: at
// least max/64, on average about max/16 after that, at most max (with the
// default 4 MiB: 64 KiB, about 320 KiB, 4 MiB). Small chunks keep what a
// scattered change (a process's heap, its stacks) makes new small; each
// costs a frame header, an index entry and a manifest line.
func cdcParams(max int) (minChunk int, mask uint32) {
	minChunk = (max / 64) &^ (cdcPage - 1)
	minChunk = min(max, minChunk+cdcPage)
	target := max / 16 / cdcPage
	if target < 1 {
		return minChunk, 0
	}
	return minChunk, 1<<(bits.Len(uint(target))-1) - 1
}

// zeroPageCRC is the CRC-32C of a zero page: such pages never cut.
var zeroPageCRC = codec.Checksum(zeroPage[:])

// zeroPage is read, never written: it stays on the shared zero page.
var zeroPage [cdcPage]byte

// pageCRCs joins a chunk's CRC-32C from its pages' (the cut decision's),
// instead of a second pass over the chunk's bytes.
var pageCRCs = codec.NewChecksumCombiner(cdcPage)

// cutter reads one file into content-defined chunks.
type cutter struct {
	r        io.Reader
	minChunk int
	mask     uint32
	carry    []byte // read past the last cut, for the next chunk
	eof      bool
}

func newCutter(r io.Reader, chunkSize int, first []byte) *cutter {
	minChunk, mask := cdcParams(chunkSize)
	c := &cutter{r: r, minChunk: minChunk, mask: mask, carry: make([]byte, 0, max(cdcRead+cdcPage, len(first)))}
	c.carry = append(c.carry, first...)
	return c
}

// next reads the next chunk into buf (its length is the chunk size) and
// sums it into s; it returns the chunk's length, and io.EOF once the file
// has ended (the chunk may then be short or empty).
func (c *cutter) next(buf []byte, s *chunkSums) (int, error) {
	s.n, s.zero, s.crc = 0, true, 0
	n := copy(buf, c.carry)
	c.carry = c.carry[:0]
	scanned := 0
	for {
		for scanned+cdcPage <= n {
			p := buf[scanned : scanned+cdcPage]
			// One zero test and one CRC-32C a page serve the cut, the
			// chunk's zero test and its CRC-32C (chunkSums.addPage).
			zero := codec.IsZero(p)
			// A chunk of zeros (no storage) ends at the first data page
			// after them, where the zero run ends: a cut by content. (A
			// cut where data meets zeros would need to know the run is
			// long; cut after minChunk bytes of data instead, as the
			// chunk's start decides, it loses the content's phase.)
			if scanned >= c.minChunk && s.zero && !zero {
				c.carry = append(c.carry, buf[scanned:n]...)
				return scanned, nil
			}
			crc := zeroPageCRC
			if !zero {
				crc = codec.Checksum(p)
			}
			s.addPage(zero, crc)
			scanned += cdcPage
			if scanned < c.minChunk || scanned == n && c.eof {
				continue
			}
			if crc&c.mask == c.mask && crc != zeroPageCRC {
				c.carry = append(c.carry, buf[scanned:n]...)
				return scanned, nil
			}
		}
		if n == len(buf) || c.eof {
			s.add(buf[scanned:n])
			if c.eof && len(c.carry) == 0 {
				return n, io.EOF
			}
			return n, nil
		}
		k, err := c.r.Read(buf[n:min(len(buf), max(c.minChunk, n+cdcRead))])
		n += k
		if err != nil {
			if !errors.Is(err, io.EOF) {
				s.add(buf[scanned:n])
				return n, err
			}
			c.eof = true
		}
	}
}
