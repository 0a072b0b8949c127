package streamer

// An archive is written on lanes (docs/FORMAT.md section 10): each lane
// has its own current segment, written in order by its own goroutine, so
// that several segment objects are written at once. Buffered writes into
// one file serialize on its inode, which caps one file at a few GB/s
// whatever the number of writers; several files do not share that lock.
//
// The caller's goroutine still places every frame, in order: it picks the
// lane, the segment and the offset, returns the frame's position at once,
// and queues the frame on the lane, which writes it there. Large DATA
// frames go to the lane with the fewest bytes queued, every other frame to
// lane 0. A segment carries a FILE frame of a file before any other frame
// of that file in it (placement announces it when the first one lands
// there), so every segment still decodes on its own. Segments are numbered
// when placement opens them, so the indexes have no gaps whatever order
// the lanes finish them in.
//
// A segment that reached the target size is finished by its lane, after
// every frame queued before, and committed in the background. The first
// failure (a write, a finish, a commit) fails the output: from then on the
// lanes write nothing and abort the segments they hold, so no segment is
// committed with a frame missing, and no manifest is written.

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

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/store"
)

// minLanePayload is the smallest DATA payload an ArchiveOutput spreads
// over its lanes and writes without a copy; smaller frames are copied and
// go to lane 0, where they cost a buffered copy rather than a hand-off.
const minLanePayload = 64 << 10

// packRun is how many payload bytes a pack output writes on one lane
// before it picks the least busy one again.
const packRun = 8 << 20

// DefaultLanes is how many segments an ArchiveOutput writes at once: one
// file takes about 3.5 GB/s of buffered writes (tmpfs, ext4, xfs), less
// than a GPU's copy out, while writes into several files scale with cores.
// Up to 16: with 8 on a 16-core H200 host the writes bound a fast-path
// checkpoint's store of 13 GB beside CRIU's dump (1.04-1.13 s; 0.89-1.05 s
// with 16, docs/bench-log/2026-11.md).
func DefaultLanes() int { return min(runtime.GOMAXPROCS(0), 16) }

// DefaultSegmentSize keeps segments large enough that per-object overhead
// does not matter and small enough for parallel transfers.
const DefaultSegmentSize = 256 << 20

// DefaultCommitting is how many finished segments of one lane an
// ArchiveOutput lets commit in the background while the lane fills its
// next one. Two let one segment's last parts and its completion overlap
// the next segment's first parts, which is all a lane needs to never wait
// on a commit; more only hold more memory (an S3 segment in commit holds
// up to Parallel parts). The output allows lanes-1 more, one for each
// other lane.
const DefaultCommitting = 2

// laneQueue is how many frames a lane holds queued: enough to keep it
// busy while placement serves the other lanes. Large payloads are the
// caller's buffers (bounded by its own tokens), small ones copies of at
// most minLanePayload bytes.
const laneQueue = 16

// ArchiveOutput writes an archive into a Store: segment objects as data
// arrives, on Lanes segments at once, then the manifest last as the
// commit point.
//
// A full segment is committed in the background (Commit of an object store
// waits for its last parts and the server's answer), at most
// DefaultCommitting+lanes-1 at once: when that many are in flight a lane
// waits, so memory stays bounded and a slow store slows the pipeline
// instead of piling up data. The first failure fails every later
// WriteFrame and Commit; the manifest is written only after every segment
// committed; Abort waits for the lanes, stops the commits in flight and
// deletes every segment.
//
// WriteFrame, WriteFrameAsync, Commit and Abort are called from one
// goroutine at a time (the pipeline's ordered writer, then its owner).
type ArchiveOutput struct {
	store       store.Store
	segmentSize int64
	streamID    uint64
	format      pipeline.Format
	nLanes      int
	start       int64 // offset of a segment's first frame, after its header
	// packs: the segments are packs of a chunk store (DedupOutput), named
	// by random ids, holding DATA frames only. Their frames stay on one
	// lane for packRun bytes at a time, so that consecutive chunks of a
	// file lie one after the other in a pack, where a reader takes them in
	// one request (source/runs.go).
	packs bool
	// packFile is the file the next pack frame belongs to (DedupOutput
	// sets it before each frame, from the one writing goroutine); sticks
	// are the lanes the files' frames stay on.
	packFile uint32
	sticks   map[uint32]*stick
	// lock keeps gc from the segments while the capture runs (nil in a
	// pack output: the chunk store's lock does).
	lock *store.Lock
	// keepSegments: the manifest's commit may have landed (errCommitUnknown),
	// so Abort leaves the segments.
	keepSegments atomic.Bool

	// placement: the caller's goroutine only
	lanes    []*lane
	next     int // where the search for the least busy lane starts
	segments []manifest.Segment
	open     map[uint32]openFile // files opened and not ended
	stopped  bool                // the lanes' queues are closed
	laneWG   sync.WaitGroup

	// background commits
	slots    chan struct{}
	bg       context.Context // canceled by Abort
	bgCancel context.CancelCauseFunc
	wg       sync.WaitGroup
	firstFailure
	mu        sync.Mutex
	committed int                   // segments committed so far
	segDone   map[int]chan struct{} // closed when a background commit ends
	abortOnce sync.Once
	abortErr  error
}

type openFile struct {
	fh   manifest.FrameHeader
	name []byte
}

// lane is one segment writer: its queue and placement's view of it.
type lane struct {
	jobs    chan laneJob
	queued  atomic.Int64 // payload bytes queued, for placement
	cur     *segment     // the segment its frames go to; nil: none open
	started bool
	stuck   int // files whose pack frames stay on it now
}

// stick keeps one file's pack frames on one lane for packRun bytes.
type stick struct {
	lane *lane
	left int
}

// segment is one segment object. Placement owns index to announced; the
// lane that writes it owns the rest, then hands it to its commit.
type segment struct {
	index     int
	name      string
	planned   int64           // where the next frame placed goes
	announced map[uint32]bool // files with a FILE frame in the segment

	w    store.ObjectWriter
	sink *countingWriter
	mw   *manifest.Writer
}

// laneJob is a frame for a lane to write at pos of seg, or with close the
// end of seg, whose size is then pos. done, when set, gets the write's
// error once payload is no longer needed.
type laneJob struct {
	seg     *segment
	close   bool
	fh      manifest.FrameHeader
	payload []byte
	pos     int64
	done    func(error)
}

// countingWriter counts the bytes the object writer accepted, so that a
// segment's size is checked before it is committed.
type countingWriter struct {
	w store.ObjectWriter
	n int64
}

func (c *countingWriter) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	c.n += int64(n)
	return n, err
}

// NewArchiveOutput writes a plain archive without chunk hashes; it, like
// NewArchiveOutputAs, refuses to overwrite a committed archive.
func NewArchiveOutput(ctx context.Context, st store.Store, segmentSize int64) (*ArchiveOutput, error) {
	return NewArchiveOutputAs(ctx, st, segmentSize, pipeline.Format{})
}

// NewArchiveOutputAs writes an archive in format f. Its segments are
// named by its stream id (manifest.SegmentName), and its manifest is
// committed only if none is there by then (store.ObjectWriter.CommitNew):
// of captures racing to one location one commits, the others fail and
// remove their segments. It holds a lock beside its segments
// (manifest.CaptureLockName) until Commit or Abort, which keeps gc from
// them.
func NewArchiveOutputAs(ctx context.Context, st store.Store, segmentSize int64, f pipeline.Format) (*ArchiveOutput, error) {
	if _, err := st.Stat(ctx, manifest.ManifestName); err == nil {
		return nil, fmt.Errorf("%s: a checkpoint already exists there; remove it first", st)
	} else if !errors.Is(err, errdefs.ErrNotFound) {
		// Not knowing is not "absent": a store we cannot reach must not be
		// written blindly, and says why now rather than mid-dump.
		return nil, fmt.Errorf("%s: %w", st, err)
	}
	a, err := newArchiveOutput(st, segmentSize, f, false)
	if err != nil {
		return nil, err
	}
	if a.lock, err = store.TakeLock(ctx, st, manifest.CaptureLockName(a.streamID), "capture"); err != nil {
		a.bgCancel(err)
		return nil, err
	}
	return a, nil
}

// newArchiveOutput is an output that writes segments (or packs) into st.
func newArchiveOutput(st store.Store, segmentSize int64, f pipeline.Format, packs bool) (*ArchiveOutput, error) {
	if segmentSize <= 0 {
		segmentSize = DefaultSegmentSize
	}
	a := &ArchiveOutput{store: st, segmentSize: segmentSize, streamID: rand.Uint64(), format: f, nLanes: DefaultLanes(), packs: packs,
		open: map[uint32]openFile{}, firstFailure: newFirstFailure(), segDone: map[int]chan struct{}{}}
	// Every segment starts with the same header (and KEY frame): where its
	// first frame goes is known before any segment is created.
	probe, err := a.newWriter(io.Discard)
	if err != nil {
		return nil, err
	}
	a.start = probe.Pos()
	a.bg, a.bgCancel = context.WithCancelCause(context.Background())
	return a, nil
}

func (a *ArchiveOutput) newWriter(w io.Writer) (*manifest.Writer, error) {
	h := streamHeader(a.format, 0, 1, a.streamID)
	h.Pack = a.packs
	mw, err := manifest.NewWriter(w, h)
	if err != nil {
		return nil, err
	}
	pipeline.SealEnd(mw, a.format.Seal)
	return mw, nil
}

// SetLanes sets how many segments are written at once (n <= 0:
// DefaultLanes); 1 writes one segment after the other. Call it before the
// first WriteFrame.
func (a *ArchiveOutput) SetLanes(n int) {
	if n <= 0 {
		n = DefaultLanes()
	}
	a.nLanes = n
}

// Format is what the archive is written as.
func (a *ArchiveOutput) Format() pipeline.Format { return a.format }

// Committed returns how many segments have been committed so far.
func (a *ArchiveOutput) Committed() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.committed
}

// WriteFrame implements Output. A large DATA payload is written before it
// returns; any other frame is copied and written later.
func (a *ArchiveOutput) WriteFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (FramePos, error) {
	if !large(fh, payload) {
		return a.place(ctx, fh, clone(payload), nil)
	}
	written := make(chan error, 1)
	loc, err := a.place(ctx, fh, payload, func(err error) { written <- err })
	if err != nil {
		return FramePos{}, err
	}
	// The lane calls done whatever happens, also after a failure or Abort.
	if err := <-written; err != nil {
		return FramePos{}, err
	}
	return loc, nil
}

// WriteFrameAsync implements AsyncOutput: a DATA payload of
// minLanePayload bytes or more is written by a lane, which calls done;
// any other frame is copied and done called before it returns.
func (a *ArchiveOutput) WriteFrameAsync(ctx context.Context, fh *manifest.FrameHeader, payload []byte, done func(error)) (FramePos, error) {
	if large(fh, payload) {
		return a.place(ctx, fh, payload, done)
	}
	loc, err := a.place(ctx, fh, clone(payload), nil)
	if err == nil {
		done(nil)
	}
	return loc, err
}

func large(fh *manifest.FrameHeader, payload []byte) bool {
	return fh.Type == manifest.FrameData && len(payload) >= minLanePayload
}

func clone(b []byte) []byte {
	if len(b) == 0 {
		return nil
	}
	return append([]byte(nil), b...)
}

// place decides where a frame goes, queues it on its lane and returns its
// FramePos. A failure to place fails the output: placement's view may
// then be ahead of what the lanes got.
func (a *ArchiveOutput) place(ctx context.Context, fh *manifest.FrameHeader, payload []byte, done func(error)) (FramePos, error) {
	loc, err := a.placeFrame(ctx, fh, payload, done)
	if err != nil {
		a.setFailure(err)
		return FramePos{}, a.failure()
	}
	return loc, nil
}

func (a *ArchiveOutput) placeFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte, done func(error)) (FramePos, error) {
	if err := a.failure(); err != nil {
		return FramePos{}, err
	}
	if a.stopped {
		return FramePos{}, errors.New("archive: frame written after Commit or Abort")
	}
	if a.lanes == nil {
		for range a.nLanes {
			a.lanes = append(a.lanes, &lane{jobs: make(chan laneJob, laneQueue)})
		}
		a.slots = make(chan struct{}, DefaultCommitting+a.nLanes-1)
	}
	l := a.lanes[0]
	switch {
	case a.packs:
		l = a.stuckLane(a.packFile, len(payload))
	case large(fh, payload):
		l = a.leastBusy()
	}
	if l.cur != nil && l.cur.planned >= a.segmentSize {
		if err := a.closeSegment(ctx, l); err != nil {
			return FramePos{}, err
		}
	}
	if l.cur == nil {
		i := len(a.segments)
		name := manifest.SegmentName(a.streamID, i)
		if a.packs {
			name = chunkstore.NewPackID().Name()
		}
		l.cur = &segment{index: i, name: name, planned: a.start, announced: map[uint32]bool{}}
		a.segments = append(a.segments, manifest.Segment{Name: l.cur.name})
	}
	s := l.cur
	if a.packs && fh.Type != manifest.FrameData {
		return FramePos{}, fmt.Errorf("pack: %s frame; a pack holds DATA frames only", fh.Type)
	}
	if !a.packs && fh.Type != manifest.FrameFile && !s.announced[fh.FileID] {
		f, ok := a.open[fh.FileID]
		if !ok {
			return FramePos{}, fmt.Errorf("archive: %s frame for file id %d, which is not open", fh.Type, fh.FileID)
		}
		if err := a.queue(ctx, l, laneJob{fh: f.fh, payload: f.name}); err != nil {
			return FramePos{}, err
		}
		s.announced[fh.FileID] = true
	}
	pos := s.planned
	if err := a.queue(ctx, l, laneJob{fh: *fh, payload: payload, done: done}); err != nil {
		return FramePos{}, err
	}
	switch fh.Type {
	case manifest.FrameFile:
		a.open[fh.FileID] = openFile{fh: *fh, name: payload}
		s.announced[fh.FileID] = true
	case manifest.FrameFileEnd:
		delete(a.open, fh.FileID)
		for _, l := range a.lanes {
			if l.cur != nil {
				delete(l.cur.announced, fh.FileID)
			}
		}
	}
	return FramePos{Segment: s.index, Pos: pos}, nil
}

// stuckLane is the lane for n payload bytes of file's in a pack: the one
// the file's last frames went to, for packRun bytes, so that a file's
// chunks lie one after the other there even when several files are
// captured at once (the GPU fast path writes 16); then the lane with the
// fewest files on it, the least busy of those.
func (a *ArchiveOutput) stuckLane(file uint32, n int) *lane {
	if a.sticks == nil {
		a.sticks = map[uint32]*stick{}
	}
	st := a.sticks[file]
	if st == nil || st.left <= 0 {
		if st != nil {
			st.lane.stuck--
		}
		best := a.leastBusy()
		for _, l := range a.lanes {
			if l.stuck < best.stuck {
				best = l
			}
		}
		best.stuck++
		st = &stick{lane: best, left: packRun}
		a.sticks[file] = st
	}
	st.left -= n
	return st.lane
}

// unstick forgets file's lane: its last frame was written.
func (a *ArchiveOutput) unstick(file uint32) {
	if st := a.sticks[file]; st != nil {
		st.lane.stuck--
		delete(a.sticks, file)
	}
}

// leastBusy is the lane with the fewest payload bytes queued, the search
// starting after the lane picked last, so equal lanes take turns.
func (a *ArchiveOutput) leastBusy() *lane {
	n := len(a.lanes)
	best := a.next % n
	for i := 1; i < n; i++ {
		k := (a.next + i) % n
		if a.lanes[k].queued.Load() < a.lanes[best].queued.Load() {
			best = k
		}
	}
	a.next = best + 1
	return a.lanes[best]
}

// queue places a frame at the end of l's current segment and hands it to
// the lane, starting the lane's goroutine at its first frame.
func (a *ArchiveOutput) queue(ctx context.Context, l *lane, j laneJob) error {
	j.seg, j.pos = l.cur, l.cur.planned
	if !j.close {
		l.cur.planned += manifest.FrameSize + int64(len(j.payload))
	}
	if !l.started {
		l.started = true
		a.laneWG.Add(1)
		go a.runLane(l)
	}
	n := int64(len(j.payload))
	l.queued.Add(n)
	select {
	case l.jobs <- j:
		return nil
	case <-ctx.Done():
		l.queued.Add(-n)
		return context.Cause(ctx)
	case <-a.bg.Done():
		l.queued.Add(-n)
		return context.Cause(a.bg)
	case <-a.failed:
		l.queued.Add(-n)
		return a.failure()
	}
}

// closeSegment queues the end of l's current segment: its END frame, tail
// and commit, after every frame queued before.
func (a *ArchiveOutput) closeSegment(ctx context.Context, l *lane) error {
	s := l.cur
	size := s.planned + manifest.FrameSize + manifest.TailSize // END has no payload
	a.segments[s.index].Size = size
	l.cur = nil
	select {
	case l.jobs <- laneJob{seg: s, close: true, pos: size}:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-a.bg.Done():
		return context.Cause(a.bg)
	case <-a.failed:
		return a.failure()
	}
}

// runLane writes l's frames in order until its queue is closed. After the
// output failed it writes nothing more, still hands every payload back,
// and aborts the segment it holds.
func (a *ArchiveOutput) runLane(l *lane) {
	defer a.laneWG.Done()
	var cur *segment // created here and not yet handed to its commit
	defer func() {
		if cur != nil {
			abortBriefly(a.bg, cur.w)
		}
	}()
	for j := range l.jobs {
		err := a.failure()
		if err == nil && a.bg.Err() != nil {
			err = context.Cause(a.bg)
		}
		if err == nil {
			err = a.write(j, &cur)
		}
		if err != nil {
			a.setFailure(err)
			if cur != nil {
				abortBriefly(a.bg, cur.w)
				cur = nil
			}
		}
		l.queued.Add(-int64(len(j.payload)))
		if j.done != nil {
			j.done(err)
		}
	}
}

// write does one job of a lane; cur is the segment the lane holds.
func (a *ArchiveOutput) write(j laneJob, cur **segment) error {
	s := j.seg
	if s.w == nil {
		w, err := a.store.Create(a.bg, s.name)
		if err != nil {
			return fmt.Errorf("create segment %s: %w", s.name, err)
		}
		*cur = s
		s.w, s.sink = w, &countingWriter{w: w}
		if s.mw, err = a.newWriter(s.sink); err != nil {
			return fmt.Errorf("segment %s: %w", s.name, err)
		}
	}
	if j.close {
		if err := s.mw.Finish(nil); err != nil {
			return fmt.Errorf("finish segment %s: %w", s.name, err)
		}
		if got := s.mw.Pos(); got != j.pos {
			return fmt.Errorf("segment %s: %d bytes written, %d placed; not committing", s.name, got, j.pos)
		}
		if s.sink.n != j.pos {
			return fmt.Errorf("segment %s: %d bytes written, the object took %d; not committing", s.name, j.pos, s.sink.n)
		}
		if err := a.commitInBackground(s); err != nil {
			return err
		}
		*cur = nil
		return nil
	}
	if got := s.mw.Pos(); got != j.pos {
		return fmt.Errorf("segment %s: %s frame placed at offset %d would land at %d", s.name, j.fh.Type, j.pos, got)
	}
	if _, err := s.mw.WriteFrame(&j.fh, j.payload); err != nil {
		return fmt.Errorf("segment %s: %w", s.name, err)
	}
	return nil
}

// commitInBackground commits s on its own goroutine once a commit slot is
// free. The goroutine owns s.w from then on, and aborts it if the commit
// fails, or the output failed meanwhile.
func (a *ArchiveOutput) commitInBackground(s *segment) error {
	select {
	case a.slots <- struct{}{}:
	case <-a.bg.Done():
		return fmt.Errorf("commit segment %s: %w", s.name, context.Cause(a.bg))
	case <-a.failed:
		return a.failure()
	}
	done := make(chan struct{})
	a.mu.Lock()
	a.segDone[s.index] = done
	a.mu.Unlock()
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		defer close(done)
		defer func() { <-a.slots }()
		err := a.failure()
		if err == nil {
			if err = s.w.Commit(a.bg); err != nil {
				err = fmt.Errorf("commit segment %s: %w", s.name, err)
			}
		}
		if err != nil {
			a.setFailure(err)
			abortBriefly(a.bg, s.w)
			return
		}
		a.mu.Lock()
		a.committed++
		a.mu.Unlock()
	}()
	return nil
}

// stopLanes closes the lanes' queues and waits until they are written.
func (a *ArchiveOutput) stopLanes() {
	if !a.stopped {
		a.stopped = true
		for _, l := range a.lanes {
			close(l.jobs)
		}
	}
	a.laneWG.Wait()
}

// Commit closes every lane's segment, waits until every segment is
// committed, proves that they are all there (prove), then writes the
// manifest and releases the lock. The lanes have ended, and every payload
// has been handed back, when it returns.
func (a *ArchiveOutput) Commit(ctx context.Context, m *manifest.Manifest) error {
	defer a.lock.Release(ctx)
	segs, err := a.commitSegments(ctx)
	if err != nil {
		return err
	}
	m.Segments = segs
	// One listing of this capture's segments: no other capture's are
	// under its stream id.
	if err := prove(ctx, a.lock, a.store, segs, fmt.Sprintf("%s%016x-", manifest.SegmentPrefix, a.streamID)); err != nil {
		return err
	}
	err = commitManifest(ctx, a.store, m, a.format)
	if errors.Is(err, errCommitUnknown) {
		a.keepSegments.Store(true)
	}
	return err
}

// commitSegments closes every lane's segment and waits until every segment
// is committed; it returns them in index order.
func (a *ArchiveOutput) commitSegments(ctx context.Context) ([]manifest.Segment, error) {
	if err := a.failure(); err == nil && !a.stopped {
		for _, l := range a.lanes {
			if l.cur == nil {
				continue
			}
			if err := a.closeSegment(ctx, l); err != nil {
				a.setFailure(err)
				break
			}
		}
	}
	a.stopLanes()
	a.wg.Wait()
	if err := a.failure(); err != nil {
		return nil, err
	}
	if n := a.Committed(); n != len(a.segments) {
		return nil, fmt.Errorf("refusing to commit: %d of %d segments committed", n, len(a.segments))
	}
	return a.segments, nil
}

// abortBriefly discards an object whose commit failed or never started,
// also when ctx has ended, within AbortTimeout.
func abortBriefly(ctx context.Context, w store.ObjectWriter) {
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), AbortTimeout)
	defer cancel()
	_ = w.Abort(actx)
}

// errAborted is the cause given to the lanes and commits in flight when
// Abort stops them.
var errAborted = errors.New("archive aborted")

// AbortTimeout bounds Abort's cleanup. Against a store that is down every
// request spends its retries; what cannot be removed in that time is left
// for `gpucr-stream gc` (without a manifest it is no checkpoint anyway).
var AbortTimeout = 10 * time.Second

// Abort stops the lanes and the commits in flight and removes the segments
// written so far; with no manifest they were never a checkpoint, so this
// is cleanup, not a correctness step. The lanes end first (a write in
// flight cannot be stopped, and would land in a file being removed; the
// rest of their queues is handed back unwritten), then everything is
// removed in parallel, within AbortTimeout. A second Abort returns the
// first one's result.
func (a *ArchiveOutput) Abort(ctx context.Context) error {
	a.abortOnce.Do(func() {
		a.abortErr = a.abort(ctx)
		a.lock.Release(ctx) // after its segments: until then gc leaves them to it
	})
	return a.abortErr
}

func (a *ArchiveOutput) abort(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, AbortTimeout)
	defer cancel()
	a.bgCancel(errAborted)
	a.stopLanes()
	if a.keepSegments.Load() {
		return nil
	}
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
	sem := make(chan struct{}, 8)
	for i, s := range a.segments {
		a.mu.Lock()
		done := a.segDone[i]
		a.mu.Unlock()
		wg.Add(1)
		go func() {
			defer wg.Done()
			// A commit that is finishing may still make its segment
			// visible: let it end first.
			if done != nil {
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
