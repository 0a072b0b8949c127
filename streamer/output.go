package streamer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store"
)

// Location is where a frame landed: segment index and header offset.
type Location struct {
	Segment int
	Pos     int64
}

// Output receives frames from the pipeline's single ordered writer.
// WriteFrame must not keep payload after it returns.
type Output interface {
	WriteFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (Location, error)
	// Commit finishes the output; m is complete except for Segments, which an
	// output that writes segments fills in.
	Commit(ctx context.Context, m *manifest.Manifest) error
	// Abort discards what was written where that is possible.
	Abort(ctx context.Context) error
}

// AsyncOutput is an Output that can write a DATA frame's payload after
// WriteFrameAsync returns, several at once (ArchiveOutput into a store
// that writes at offsets); a Capture uses it when its Output has it, and
// an Output that wraps another passes it on. The frame's place, its Location, is decided at
// once and in order, as by WriteFrame. done is called exactly once, from
// any goroutine, when payload is no longer needed, with the write's error
// (which also fails the output's later calls); it is not called when
// WriteFrameAsync returns an error. Commit and Abort wait for every write.
type AsyncOutput interface {
	Output
	WriteFrameAsync(ctx context.Context, fh *manifest.FrameHeader, payload []byte, done func(error)) (Location, error)
}

// minAsyncPayload is the smallest DATA payload an ArchiveOutput writes
// on a payload writer: below it the flush and the goroutine cost more than
// the copy, and the payload goes through the segment's buffer.
const minAsyncPayload = 64 << 10

// DefaultWriters is how many DATA payloads an ArchiveOutput writes at once
// into a store that writes at offsets (store.WriterAt): a single writer
// copies about 2.4 GB/s into /dev/shm, less than a GPU's copy out, while
// memory copies into the page cache scale with cores.
func DefaultWriters() int { return min(runtime.GOMAXPROCS(0), 8) }

// DefaultSegmentSize keeps segments large enough that per-object overhead
// does not matter and small enough for parallel transfers.
const DefaultSegmentSize = 256 << 20

// DefaultCommitting is how many finished segments an ArchiveOutput lets
// commit in the background while the next one fills. Two let one segment's
// last parts and its completion overlap the next segment's first parts,
// which is all the pipeline needs to never wait on a commit; more only
// hold more memory (an S3 segment in commit holds up to Parallel parts).
const DefaultCommitting = 2

// ArchiveOutput writes an archive into a Store: segment objects as data
// arrives, then the manifest last as the commit point.
//
// A full segment is committed in the background (Commit of an object store
// waits for its last parts and the server's answer), at most Committing at
// once: when that many are in flight the writer waits, so memory stays
// bounded and a slow store slows the pipeline instead of piling up data.
// The first failed commit fails every later WriteFrame and Commit; the
// manifest is written only after every segment committed; Abort stops the
// commits in flight and deletes every segment.
//
// Into a store that writes at offsets, WriteFrameAsync hands a large DATA
// payload to one of Writers goroutines: the caller's goroutine still
// places every frame in order (the header is written and the payload's
// room skipped, see manifest.Writer.WriteDataHeader), so the bytes are
// those of one writer. A segment is committed only once every payload
// write into it ended; the first failed write fails the output like a
// failed commit, and no segment with a hole is committed.
type ArchiveOutput struct {
	store       store.Store
	segmentSize int64
	cur         store.ObjectWriter
	curWriter   *manifest.Writer
	curSink     *segmentSink
	segments    []manifest.Segment
	streamID    uint64
	seal        *crypt.Session
	// open files, re-announced at the start of every new segment
	open map[uint32]openFile

	// payload writes
	writers    int           // at once; 1: every byte from the caller's goroutine
	writeSlots chan struct{} // writers of them, made at the first write
	writes     sync.WaitGroup

	// background commits
	slots     chan struct{}   // DefaultCommitting of them
	bg        context.Context // canceled by Abort
	bgCancel  context.CancelCauseFunc
	wg        sync.WaitGroup
	segDone   map[int]chan struct{} // closed when a background commit ends
	failed    chan struct{}         // closed with the first commit failure
	orphans   []store.ObjectWriter  // segments not committed, for Abort to discard
	mu        sync.Mutex
	commitErr error
	committed int // segments committed so far
	abortOnce sync.Once
	abortErr  error
}

type openFile struct {
	fh   manifest.FrameHeader
	name []byte
}

// segmentSink is what a segment's manifest.Writer writes into. It counts
// the bytes the object writer accepted, payload writes included, so that a
// segment's size is checked before it is committed. With at set it writes
// everything at offsets and skips the payloads that payload writers fill
// (manifest.Skipper); only the caller's goroutine calls Write and Skip.
type segmentSink struct {
	w        store.ObjectWriter
	at       store.WriterAt // w, when payloads are written on their own
	off      int64          // where Write writes next, with at
	n        atomic.Int64
	payloads sync.WaitGroup // payload writes into the segment in flight
}

func (s *segmentSink) Write(b []byte) (int, error) {
	var n int
	var err error
	if s.at != nil {
		n, err = s.at.WriteAt(b, s.off)
		s.off += int64(n)
	} else {
		n, err = s.w.Write(b)
	}
	s.n.Add(int64(n))
	return n, err
}

func (s *segmentSink) Skip(n int64) error {
	if s.at == nil {
		return errors.New("segment is written in order: no room can be left")
	}
	s.off += n
	return nil
}

// writePayload writes a DATA payload at off, as one of the payload writers.
func (s *segmentSink) writePayload(p []byte, off int64) error {
	n, err := s.at.WriteAt(p, off)
	s.n.Add(int64(n))
	if err == nil && n < len(p) {
		err = io.ErrShortWrite
	}
	return err
}

// NewArchiveOutput refuses to overwrite a committed archive.
func NewArchiveOutput(ctx context.Context, st store.Store, segmentSize int64) (*ArchiveOutput, error) {
	return NewSealedArchiveOutput(ctx, st, segmentSize, nil)
}

// NewSealedArchiveOutput writes an encrypted archive under seal (nil: a
// plain one).
func NewSealedArchiveOutput(ctx context.Context, st store.Store, segmentSize int64, seal *crypt.Session) (*ArchiveOutput, error) {
	if _, err := st.Stat(ctx, manifest.ManifestName); err == nil {
		return nil, fmt.Errorf("%s: a checkpoint already exists there; remove it first", st)
	} else if !errors.Is(err, errdefs.ErrNotFound) {
		// Not knowing is not "absent": a store we cannot reach must not be
		// written blindly, and says why now rather than mid-dump.
		return nil, fmt.Errorf("%s: %w", st, err)
	}
	if segmentSize <= 0 {
		segmentSize = DefaultSegmentSize
	}
	bg, cancel := context.WithCancelCause(context.Background())
	return &ArchiveOutput{store: st, segmentSize: segmentSize, streamID: rand.Uint64(), seal: seal, open: map[uint32]openFile{},
		writers: DefaultWriters(), slots: make(chan struct{}, DefaultCommitting), bg: bg, bgCancel: cancel, failed: make(chan struct{})}, nil
}

// SetWriters sets how many DATA payloads WriteFrameAsync writes at once
// (n <= 0: DefaultWriters); 1 writes every byte from the caller's
// goroutine, as into a store that cannot write at offsets. Call it before
// the first WriteFrame.
func (a *ArchiveOutput) SetWriters(n int) {
	if n <= 0 {
		n = DefaultWriters()
	}
	a.writers = n
}

// Sealed is the session the archive is encrypted under, or nil.
func (a *ArchiveOutput) Sealed() *crypt.Session { return a.seal }

// Committed returns how many segments have been committed so far.
func (a *ArchiveOutput) Committed() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.committed
}

func (a *ArchiveOutput) failure() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.commitErr
}

func (a *ArchiveOutput) setFailure(err error) {
	a.mu.Lock()
	if a.commitErr == nil {
		a.commitErr = err
		close(a.failed)
	}
	a.mu.Unlock()
}

func (a *ArchiveOutput) openSegment(ctx context.Context) error {
	i := len(a.segments)
	name := manifest.SegmentName(i)
	w, err := a.store.Create(ctx, name)
	if err != nil {
		return fmt.Errorf("create segment %s: %w", name, err)
	}
	sink := &segmentSink{w: w}
	if a.writers > 1 {
		sink.at, _ = w.(store.WriterAt)
	}
	mw, err := manifest.NewWriter(sink, manifest.Header{ShardIndex: 0, ShardCount: 1, StreamID: a.streamID, Encryption: encryptionOf(a.seal)})
	if err != nil {
		_ = w.Abort(ctx)
		return fmt.Errorf("segment %s: %w", name, err)
	}
	sealEnd(mw, a.seal)
	a.cur, a.curWriter, a.curSink = w, mw, sink
	a.segments = append(a.segments, manifest.Segment{Name: name})
	for _, f := range a.open {
		fh := f.fh
		if _, err := mw.WriteFrame(&fh, f.name); err != nil {
			return fmt.Errorf("segment %s: %w", name, err)
		}
	}
	return nil
}

// closeSegment finishes the current segment and commits it: in the
// background when wait is false, else before it returns.
func (a *ArchiveOutput) closeSegment(ctx context.Context, wait bool) error {
	if a.cur == nil {
		return nil
	}
	seg := &a.segments[len(a.segments)-1]
	if err := a.curWriter.Finish(nil); err != nil {
		return fmt.Errorf("finish segment %s: %w", seg.Name, err)
	}
	seg.Size = a.curWriter.Pos()
	w, sink, name, size := a.cur, a.curSink, seg.Name, seg.Size
	a.cur, a.curWriter, a.curSink = nil, nil, nil
	// A failed commit is cleaned up after the failure is reported: by
	// Abort, or after setFailure in the background, never while the
	// pipeline (and CRIU, and the frozen process) waits.
	commit := func(ctx context.Context) error {
		// Nothing with a hole is committed: every payload write into the
		// segment ends first, and none may have failed.
		sink.payloads.Wait()
		if err := a.failure(); err != nil {
			return err
		}
		if got := sink.n.Load(); got != size {
			return fmt.Errorf("segment %s: %d bytes written, the object took %d; not committing", name, size, got)
		}
		if err := w.Commit(ctx); err != nil {
			return fmt.Errorf("commit segment %s: %w", name, err)
		}
		a.mu.Lock()
		a.committed++
		a.mu.Unlock()
		return nil
	}
	if wait {
		err := commit(ctx)
		if err != nil {
			a.orphans = append(a.orphans, w)
		}
		return err
	}
	return a.commitInBackground(ctx, w, name, commit)
}

// commitInBackground runs commit on its own goroutine once one of the
// DefaultCommitting slots is free.
func (a *ArchiveOutput) commitInBackground(ctx context.Context, w store.ObjectWriter, name string, commit func(context.Context) error) error {
	select {
	case a.slots <- struct{}{}:
	case <-ctx.Done():
		a.orphans = append(a.orphans, w)
		return fmt.Errorf("commit segment %s: %w", name, context.Cause(ctx))
	case <-a.bg.Done():
		a.orphans = append(a.orphans, w)
		return fmt.Errorf("commit segment %s: %w", name, context.Cause(a.bg))
	case <-a.failed:
		// An earlier segment failed: stop now, not when its slot frees.
		a.orphans = append(a.orphans, w)
		return a.failure()
	}
	// The commit ends with ctx (the pipeline failed) or with Abort.
	cctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(a.bg, func() { cancel(context.Cause(a.bg)) })
	done := make(chan struct{})
	if a.segDone == nil {
		a.segDone = map[int]chan struct{}{}
	}
	a.segDone[len(a.segments)-1] = done
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		defer close(done)
		defer func() { <-a.slots }()
		defer stop()
		defer cancel(nil)
		if err := commit(cctx); err != nil {
			a.setFailure(err)
			abortBriefly(cctx, w)
		}
	}()
	return nil
}

// nextSegment makes the current segment the one the next frame goes
// into: it commits a full one and opens a new one.
func (a *ArchiveOutput) nextSegment(ctx context.Context) error {
	if err := a.failure(); err != nil {
		return err
	}
	if a.cur != nil && a.curWriter.Pos() >= a.segmentSize {
		if err := a.closeSegment(ctx, false); err != nil {
			return err
		}
	}
	if a.cur == nil {
		return a.openSegment(ctx)
	}
	return nil
}

// WriteFrame implements Output. FILE frames are repeated in each segment
// that carries the file's data, so every segment decodes on its own.
func (a *ArchiveOutput) WriteFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (Location, error) {
	if err := a.nextSegment(ctx); err != nil {
		return Location{}, err
	}
	return a.writeFrame(fh, payload)
}

// WriteFrameAsync is WriteFrame for a frame whose payload may be written
// after it returns (see AsyncOutput): a DATA payload of minAsyncPayload
// bytes or more, into a store that writes at offsets, goes to a payload
// writer once one of Writers is free; any other frame is written at once
// and done called before it returns.
func (a *ArchiveOutput) WriteFrameAsync(ctx context.Context, fh *manifest.FrameHeader, payload []byte, done func(error)) (Location, error) {
	if err := a.nextSegment(ctx); err != nil {
		return Location{}, err
	}
	if fh.Type != manifest.FrameData || len(payload) < minAsyncPayload || a.curSink.at == nil {
		loc, err := a.writeFrame(fh, payload)
		if err == nil {
			done(nil)
		}
		return loc, err
	}
	slots, err := a.writeSlot(ctx)
	if err != nil {
		return Location{}, err
	}
	seg, sink := len(a.segments)-1, a.curSink
	name := a.segments[seg].Name
	pos, err := a.curWriter.WriteDataHeader(fh, len(payload))
	if err != nil {
		<-slots
		return Location{}, fmt.Errorf("segment %s: %w", name, err)
	}
	off := pos + manifest.FrameSize
	a.writes.Add(1)
	sink.payloads.Add(1)
	go func() {
		err := sink.writePayload(payload, off)
		if err != nil {
			err = fmt.Errorf("segment %s: write %d bytes at offset %d: %w", name, len(payload), off, err)
			a.setFailure(err)
		}
		<-slots
		// done before the waits end: when Commit or Abort returns, every
		// payload is back with its owner.
		done(err)
		sink.payloads.Done()
		a.writes.Done()
	}()
	return Location{Segment: seg, Pos: pos}, nil
}

// writeSlot waits until fewer than Writers payload writes are in flight
// and takes a slot, which the write gives back on the returned channel.
func (a *ArchiveOutput) writeSlot(ctx context.Context) (chan struct{}, error) {
	if a.writeSlots == nil {
		a.writeSlots = make(chan struct{}, a.writers)
	}
	select {
	case a.writeSlots <- struct{}{}:
		return a.writeSlots, nil
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	case <-a.bg.Done():
		return nil, context.Cause(a.bg)
	case <-a.failed:
		return nil, a.failure()
	}
}

func (a *ArchiveOutput) writeFrame(fh *manifest.FrameHeader, payload []byte) (Location, error) {
	pos, err := a.curWriter.WriteFrame(fh, payload)
	if err != nil {
		return Location{}, fmt.Errorf("segment %s: %w", a.segments[len(a.segments)-1].Name, err)
	}
	switch fh.Type {
	case manifest.FrameFile:
		a.open[fh.FileID] = openFile{fh: *fh, name: append([]byte(nil), payload...)}
	case manifest.FrameFileEnd:
		delete(a.open, fh.FileID)
	}
	return Location{Segment: len(a.segments) - 1, Pos: pos}, nil
}

// Commit closes the last segment, waits until every segment is committed,
// then writes the manifest. It returns after every payload write ended.
func (a *ArchiveOutput) Commit(ctx context.Context, m *manifest.Manifest) error {
	defer a.writes.Wait()
	if err := a.failure(); err != nil {
		return err
	}
	if err := a.closeSegment(ctx, true); err != nil {
		return err
	}
	a.wg.Wait()
	if err := a.failure(); err != nil {
		return err
	}
	if n := a.Committed(); n != len(a.segments) {
		return fmt.Errorf("refusing to commit: %d of %d segments committed", n, len(a.segments))
	}
	m.Segments = a.segments
	if err := m.Validate(); err != nil {
		return fmt.Errorf("refusing to commit: %w", err)
	}
	doc, err := marshalManifest(m, a.seal)
	if err != nil {
		return err
	}
	w, err := a.store.Create(ctx, manifest.ManifestName)
	if err != nil {
		return fmt.Errorf("create manifest: %w", err)
	}
	if _, err := w.Write(doc); err != nil {
		_ = w.Abort(ctx)
		return fmt.Errorf("write manifest: %w", err)
	}
	if err := w.Commit(ctx); err != nil {
		_ = w.Abort(ctx)
		return fmt.Errorf("commit manifest: %w", err)
	}
	return nil
}

// abortBriefly discards an object whose commit failed or never started,
// also when ctx has ended, within AbortTimeout.
func abortBriefly(ctx context.Context, w store.ObjectWriter) {
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), AbortTimeout)
	defer cancel()
	_ = w.Abort(actx)
}

// errAborted is the cause given to commits in flight when Abort stops them.
var errAborted = errors.New("archive aborted")

// AbortTimeout bounds Abort's cleanup. Against a store that is down every
// request spends its retries; what cannot be removed in that time is left
// for `gpucr-stream gc` (without a manifest it is no checkpoint anyway).
var AbortTimeout = 10 * time.Second

// Abort stops the commits in flight and removes the segments written so
// far; with no manifest they were never a checkpoint, so this is cleanup,
// not a correctness step. Everything is removed in parallel, within
// AbortTimeout, once the payload writes in flight ended; a second Abort
// returns the first one's result.
func (a *ArchiveOutput) Abort(ctx context.Context) error {
	a.abortOnce.Do(func() { a.abortErr = a.abort(ctx) })
	return a.abortErr
}

func (a *ArchiveOutput) abort(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, AbortTimeout)
	defer cancel()
	a.bgCancel(errAborted)
	// A payload write cannot be stopped, and would land in a file that is
	// being removed: let those in flight end (a local write does).
	a.writes.Wait()
	var mu sync.Mutex
	var first error
	record := func(err error) {
		mu.Lock()
		if first == nil {
			first = err
		}
		mu.Unlock()
	}
	var wg sync.WaitGroup
	if a.cur != nil {
		a.orphans = append(a.orphans, a.cur)
		a.cur = nil
	}
	for _, w := range a.orphans {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := w.Abort(ctx); err != nil {
				record(err)
			}
		}()
	}
	a.orphans = nil
	sem := make(chan struct{}, 8)
	for i, s := range a.segments {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// A commit that is finishing may still make its segment
			// visible: let it end first.
			if done := a.segDone[i]; done != nil {
				select {
				case <-done:
				case <-ctx.Done():
				}
			}
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				record(fmt.Errorf("delete %s: %w", s.Name, ctx.Err()))
				return
			}
			defer func() { <-sem }()
			if err := a.store.Delete(ctx, s.Name); err != nil {
				record(err)
			}
		}()
	}
	wg.Wait()
	return first
}
