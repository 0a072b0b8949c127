package cisformat

// Design: one goroutine per shard reads that shard's next marker and then
// parks until the merger has consumed it (and its data), so every shard is
// read at most one marker ahead: memory stays bounded whatever the stream
// says, and a writer blocked on a full shard is never waited on by a reader
// blocked on another (the real tool polls for the same reason). The merger
// hands markers out in seq order; the data of a file_data marker is read
// from its shard by the caller, through Reader.Read, while that shard's
// goroutine is parked.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
)

// MaxOpenFiles bounds the files a stream may hold open at once (CRIU keeps
// a handful open); beyond it the stream is refused rather than letting it
// grow the reader's state without limit.
const MaxOpenFiles = 1 << 16

// EventKind is what Next found.
type EventKind uint8

const (
	// Open starts a file (a name seen before and closed starts it anew: the
	// later copy replaces the earlier one).
	Open EventKind = iota + 1
	// Data is Size bytes of the named file, read through Reader.Read.
	Data
	// Close ends the named file.
	Close
)

// Event is one step of the image, in the order the writer produced it.
type Event struct {
	Kind EventKind
	Name string
	Size int64 // Data
}

// ShardStat is what the real tool reports per shard: the bytes read from
// it (markers, their length prefixes and data) and how long it took until
// its end.
type ShardStat struct {
	Size     int64
	Duration time.Duration
}

type shard struct {
	name   string
	r      io.Reader
	off    int64 // bytes read so far; the Size of its ShardStat
	end    time.Duration
	resume chan struct{}
	lenBuf [4]byte
	buf    []byte
}

type pending struct {
	sh  *shard
	m   Marker
	pos int64 // offset of the marker's length prefix in its shard
	eof bool  // the shard ended cleanly
	err error
}

// Reader merges the shards of one stream. It is not safe for concurrent use.
type Reader struct {
	ctx     context.Context
	shards  []*shard
	results chan pending
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	start   time.Time

	waiting  map[uint64]pending // at most one per live shard
	live     int
	seq      uint64
	open     map[string]bool
	current  string
	imageEOF bool
	err      error

	// The file_data being read: its shard and bytes left.
	data     *shard
	dataLeft int64
	dataPos  int64
}

// NewReader starts reading the shards; names label them in errors. Close
// must be called; it closes shards that are io.Closers to stop their
// goroutines (a shard that may block must be one, as pipes and files are).
func NewReader(ctx context.Context, shards []io.Reader, names []string) *Reader {
	ctx, cancel := context.WithCancel(ctx)
	r := &Reader{
		ctx:     ctx,
		results: make(chan pending, len(shards)),
		cancel:  cancel,
		start:   time.Now(),
		waiting: map[uint64]pending{},
		live:    len(shards),
		open:    map[string]bool{},
	}
	for i, sr := range shards {
		sh := &shard{name: names[i], r: sr, resume: make(chan struct{}, 1)}
		r.shards = append(r.shards, sh)
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			r.readShard(ctx, sh)
		}()
	}
	// A shard blocked in Read is woken by closing it. Never stopped (a stop
	// racing the cancel could keep the shards open): Close cancels, so it
	// always runs, and Close waits for it.
	r.wg.Add(1)
	context.AfterFunc(ctx, func() {
		defer r.wg.Done()
		for _, sr := range shards {
			if c, ok := sr.(io.Closer); ok {
				c.Close()
			}
		}
	})
	return r
}

func (r *Reader) readShard(ctx context.Context, sh *shard) {
	for {
		p := pending{sh: sh, pos: sh.off}
		p.m, p.eof, p.err = sh.next()
		if p.eof {
			sh.end = time.Since(r.start)
		}
		select {
		case r.results <- p:
		case <-ctx.Done():
			return
		}
		if p.eof || p.err != nil {
			return
		}
		select {
		case <-sh.resume:
		case <-ctx.Done():
			return
		}
	}
}

// next reads one marker; eof is true at a clean end of the shard.
func (sh *shard) next() (m Marker, eof bool, err error) {
	pos := sh.off
	n, err := io.ReadFull(sh.r, sh.lenBuf[:])
	sh.off += int64(n)
	if err == io.EOF {
		return m, true, nil
	}
	if err != nil {
		return m, false, sh.errorf(pos, "reading marker length: %w", unexpected(err))
	}
	size := binary.LittleEndian.Uint32(sh.lenBuf[:])
	if size >= MaxMarkerLen {
		return m, false, sh.errorf(pos, "marker of %d bytes (the limit is %d): %w", size, MaxMarkerLen, errdefs.ErrCorrupt)
	}
	if cap(sh.buf) < int(size) {
		sh.buf = make([]byte, size)
	}
	b := sh.buf[:size]
	n, err = io.ReadFull(sh.r, b)
	sh.off += int64(n)
	if err != nil {
		return m, false, sh.errorf(pos, "reading marker of %d bytes: %w", size, unexpected(err))
	}
	m, err = ParseMarker(b)
	if err != nil {
		return m, false, sh.errorf(pos, "%w", err)
	}
	return m, false, nil
}

func (sh *shard) errorf(pos int64, format string, args ...any) error {
	return fmt.Errorf("%s at offset %d: %w", sh.name, pos, fmt.Errorf(format, args...))
}

// unexpected turns an EOF inside a marker into a corrupt-input error.
func unexpected(err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("stream truncated: %w", errdefs.ErrCorrupt)
	}
	return err
}

func (r *Reader) corrupt(p pending, format string, args ...any) error {
	return p.sh.errorf(p.pos, "marker seq %d: %s: %w", p.m.Seq, fmt.Sprintf(format, args...), errdefs.ErrCorrupt)
}

// Next returns the next event; io.EOF once every shard ended cleanly after
// the image_eof marker. Unread data of the previous event is skipped.
func (r *Reader) Next() (Event, error) {
	if r.err != nil {
		return Event{}, r.err
	}
	if r.data != nil {
		if _, err := io.Copy(io.Discard, r); err != nil {
			return Event{}, r.fail(err)
		}
		r.release(r.data)
	}
	for {
		p, ok := r.waiting[r.seq]
		if !ok {
			if err := r.receive(); err != nil {
				if err == io.EOF {
					return Event{}, io.EOF
				}
				return Event{}, r.fail(err)
			}
			continue
		}
		delete(r.waiting, r.seq)
		r.seq++
		ev, emit, err := r.apply(p)
		if err != nil {
			return Event{}, r.fail(err)
		}
		if ev.Kind == Data && ev.Size > 0 {
			r.data, r.dataLeft, r.dataPos = p.sh, ev.Size, p.sh.off
		} else {
			r.release(p.sh)
		}
		if emit {
			return ev, nil
		}
	}
}

// receive waits for one more marker (or shard end) and files it.
func (r *Reader) receive() error {
	if r.live == 0 {
		if r.imageEOF {
			return io.EOF
		}
		return fmt.Errorf("stream truncated: every shard ended before the image_eof marker (next seq %d): %w", r.seq, errdefs.ErrCorrupt)
	}
	if len(r.waiting) == r.live {
		// Every live shard holds a marker and none is the next: it is lost.
		var first pending
		for _, p := range r.waiting {
			if first.sh == nil || p.m.Seq < first.m.Seq {
				first = p
			}
		}
		return r.corrupt(first, "marker seq %d is missing from every shard", r.seq)
	}
	var p pending
	select {
	case p = <-r.results:
	case <-r.ctx.Done():
		return fmt.Errorf("reading the stream: %w", r.ctx.Err())
	}
	switch {
	case p.err != nil:
		return p.err
	case p.eof:
		r.live--
		return nil
	case r.imageEOF:
		return r.corrupt(p, "data after the image_eof marker")
	case p.m.Seq < r.seq:
		return r.corrupt(p, "sequence number already used")
	}
	if _, dup := r.waiting[p.m.Seq]; dup {
		return r.corrupt(p, "sequence number used twice")
	}
	r.waiting[p.m.Seq] = p
	return nil
}

// apply checks a marker against the state and returns the event it makes,
// if any.
func (r *Reader) apply(p pending) (Event, bool, error) {
	m := p.m
	switch m.Kind {
	case Filename:
		if !manifest.ValidName(m.Name) {
			return Event{}, false, r.corrupt(p, "unsafe file name %q", m.Name)
		}
		r.current = m.Name
		if r.open[m.Name] {
			return Event{}, false, nil // back to a file that is still open
		}
		if len(r.open) >= MaxOpenFiles {
			return Event{}, false, r.corrupt(p, "more than %d files open at once", MaxOpenFiles)
		}
		r.open[m.Name] = true
		return Event{Kind: Open, Name: m.Name}, true, nil
	case FileData:
		if r.current == "" {
			return Event{}, false, r.corrupt(p, "file_data with no file selected")
		}
		return Event{Kind: Data, Name: r.current, Size: int64(m.Size)}, m.Size > 0, nil
	case FileEOF:
		if r.current == "" {
			return Event{}, false, r.corrupt(p, "file_eof with no file selected")
		}
		name := r.current
		delete(r.open, name)
		r.current = ""
		return Event{Kind: Close, Name: name}, true, nil
	case ImageEOF:
		if len(r.open) > 0 {
			for name := range r.open {
				return Event{}, false, r.corrupt(p, "image_eof while %s (and %d more) is still open", name, len(r.open)-1)
			}
		}
		r.imageEOF = true
		return Event{}, false, nil
	}
	return Event{}, false, r.corrupt(p, "unknown marker kind %d", m.Kind)
}

// release lets a shard read its next marker.
func (r *Reader) release(sh *shard) {
	if r.data == sh {
		r.data = nil
	}
	sh.resume <- struct{}{}
}

// Read reads the data of the current Data event.
func (r *Reader) Read(b []byte) (int, error) {
	if r.data == nil || r.dataLeft == 0 {
		return 0, io.EOF
	}
	if int64(len(b)) > r.dataLeft {
		b = b[:r.dataLeft]
	}
	n, err := r.data.r.Read(b)
	r.data.off += int64(n)
	r.dataLeft -= int64(n)
	if err == io.EOF && r.dataLeft > 0 {
		err = r.data.errorf(r.dataPos, "file_data of %s: %d bytes missing: %w", r.current, r.dataLeft, unexpected(io.EOF))
	}
	if err != nil && err != io.EOF {
		return n, r.fail(err)
	}
	return n, nil
}

func (r *Reader) fail(err error) error {
	if r.err == nil {
		r.err = err
	}
	return r.err
}

// Stats returns each shard's ShardStat; complete once Next returned io.EOF.
func (r *Reader) Stats() []ShardStat {
	out := make([]ShardStat, len(r.shards))
	for i, sh := range r.shards {
		out[i] = ShardStat{Size: sh.off, Duration: sh.end}
	}
	return out
}

// Close stops the shard goroutines and waits for them.
func (r *Reader) Close() error {
	r.cancel()
	r.wg.Wait()
	return nil
}
