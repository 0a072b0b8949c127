package source

import (
	"fmt"
	"io"
)

// Span is a byte range of a file: [Off, Off+Len).
type Span struct{ Off, Len int64 }

// End is where the span ends.
func (s Span) End() int64 { return s.Off + s.Len }

// Omit is a writer to hand Copy for a file served without some of its
// bytes (capture's sparse pages: a pages image without the zero pages its
// pagemap no longer lists). Copy into an Omit writes the file's bytes
// outside Spans to W, in order, and drops the rest; the sources here skip
// an omitted chunk without splicing or writing a byte of it, any other
// source's plain writes are cut by Write. Spans must be sorted and
// disjoint. One Omit serves one Copy.
type Omit struct {
	W     io.Writer
	Spans []Span
	pos   int64 // the file offset of the next byte handed to it
	next  int   // the first span not wholly behind pos
}

// NewOmit checks spans and returns an Omit writing to w.
func NewOmit(w io.Writer, spans []Span) (*Omit, error) {
	var end int64
	for i, s := range spans {
		if s.Off < end || s.Len <= 0 {
			return nil, fmt.Errorf("omitted span %d (offset %d, %d bytes): not sorted, disjoint and non-empty", i, s.Off, s.Len)
		}
		end = s.End()
	}
	return &Omit{W: w, Spans: spans}, nil
}

// Write writes what of b lies outside the spans; it reports all of b taken.
func (o *Omit) Write(b []byte) (int, error) {
	err := o.keep(int64(len(b)), func(from, to int64) error {
		_, err := o.W.Write(b[from:to])
		return err
	})
	if err != nil {
		return 0, err
	}
	return len(b), nil
}

// keep advances over the next n bytes of the file, calling fn for each
// piece of them outside the spans, as offsets into those n bytes.
func (o *Omit) keep(n int64, fn func(from, to int64) error) error {
	start, end := o.pos, o.pos+n
	o.pos = end
	at := start
	for at < end {
		for o.next < len(o.Spans) && o.Spans[o.next].End() <= at {
			o.next++
		}
		if o.next == len(o.Spans) || o.Spans[o.next].Off >= end {
			return fn(at-start, end-start)
		}
		s := o.Spans[o.next]
		if s.Off > at {
			if err := fn(at-start, s.Off-start); err != nil {
				return err
			}
		}
		at = min(s.End(), end)
	}
	return nil
}

// kept advances over bs, the next bytes of the file, and returns the
// pieces of them outside the spans.
func (o *Omit) kept(bs [][]byte) [][]byte {
	var n int64
	for _, b := range bs {
		n += int64(len(b))
	}
	out := bs[:0:0]
	_ = o.keep(n, func(from, to int64) error {
		var base int64
		for _, b := range bs {
			if lo, hi := max(from-base, 0), min(to-base, int64(len(b))); lo < hi {
				out = append(out, b[lo:hi])
			}
			base += int64(len(b))
		}
		return nil
	})
	return out
}

// Written is how many bytes of the file the Omit has been handed.
func (o *Omit) Written() int64 { return o.pos }
