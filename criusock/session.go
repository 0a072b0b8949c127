package criusock

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/streamer"
)

// Hooks report the protocol's milestones (criu-image-streamer's progress
// lines). Any of them may be nil.
type Hooks struct {
	// Listening runs once the socket accepts connections: CRIU may start.
	Listening func()
	// Connected runs when CRIU connects.
	Connected func()
	// Log takes diagnostic lines: a file the restore closed before
	// reading it all.
	Log func(string)
}

// log passes s to Log, if there is one.
func (h Hooks) log(s string) {
	if h.Log != nil {
		h.Log(s)
	}
}

// connKind says who is on a connection of an image-streamer socket.
type connKind int

const (
	connUnknown  connKind = iota // accepted; its first request not read yet
	connCRIU                     // criu dump/restore (or a client speaking as CRIU)
	connProducer                 // an external producer: its first request was a hello
)

// session is everything on one image-streamer socket: CRIU's connection, the
// producers' connections, and the pipes they opened. Every pipe is moved by
// its own goroutine, since CRIU keeps many open at once and writes or reads
// them in an order of its own, and producers push or pull several files at
// once. A failure anywhere fails the whole session: every connection and
// pipe is closed, so that CRIU and each producer see EPIPE or EOF at once
// and give up (CRIU then resumes the dumped process).
type session struct {
	handlers sync.WaitGroup // connection handlers
	wg       sync.WaitGroup // pipes
	mu       sync.Mutex
	pipes    map[*os.File]struct{}
	conns    map[*net.UnixConn]connKind
	err      error
	fail     context.CancelCauseFunc

	want          int  // producers to wait for before the session may end
	criuSeen      bool // a connection identified as CRIU
	criuClosed    bool // a CRIU connection has closed
	producersSeen int
	producersDone int // producer connections closed cleanly
	sealed        bool
	ended         chan struct{} // closed once the session may end: no more connections
	endedOnce     sync.Once
	changed       chan struct{} // closed and replaced on every change
	connectTimer  *time.Timer   // ends the wait for CRIU to connect; nil: no limit
}

// DefaultConnectTimeout is how long Intake and Serve wait for CRIU to
// connect when their options leave it zero.
const DefaultConnectTimeout = 2 * time.Minute

// ErrNoCRIU means CRIU did not connect to the image-streamer socket in time.
var ErrNoCRIU = errors.New("criu did not connect")

// limitConnectWait aborts the session if no CRIU connection is identified
// within d (d < 0: no limit). A connection that is open but has not sent its
// first request yet gets another d.
func (s *session) limitConnectWait(d time.Duration, path string) {
	if d == 0 {
		d = DefaultConnectTimeout
	}
	if d < 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.connectTimer = time.AfterFunc(d, func() {
		s.mu.Lock()
		waiting := !s.criuSeen
		for _, k := range s.conns {
			if k == connUnknown {
				waiting = false
				s.connectTimer.Reset(d)
			}
		}
		s.mu.Unlock()
		if waiting {
			s.abort(fmt.Errorf("%w to %s within %s", ErrNoCRIU, path, d))
		}
	})
}

// countingReader tracks the socket offset for error messages.
type countingReader struct {
	r io.Reader
	n *atomic.Int64
}

func (c countingReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.n.Add(int64(n))
	return n, err
}

func newSession(parent context.Context, wantProducers int) (*session, context.Context) {
	ctx, cancel := context.WithCancelCause(parent)
	s := &session{pipes: map[*os.File]struct{}{}, conns: map[*net.UnixConn]connKind{}, fail: cancel,
		want: wantProducers, ended: make(chan struct{}), changed: make(chan struct{})}
	// On failure close everything CRIU and the producers hold the other end
	// of, so that they see EPIPE or EOF at once and give up (CRIU resumes
	// the dumped process).
	context.AfterFunc(ctx, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.err == nil && parent.Err() != nil {
			// Interrupted: that is the session's error, not the closed
			// pipes that follow from it.
			s.err = context.Cause(parent)
		}
		for c := range s.conns {
			c.Close()
		}
		for p := range s.pipes {
			p.Close()
		}
	})
	return s, ctx
}

func (s *session) abort(err error) {
	s.mu.Lock()
	if s.err == nil {
		s.err = err
	}
	s.mu.Unlock()
	s.fail(err)
}

// notifyLocked wakes whoever waits on a change (Drained).
func (s *session) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// checkEndedLocked ends the session once CRIU has come and gone, every
// connection has closed and the producers it waits for have all finished.
func (s *session) checkEndedLocked() {
	if s.criuClosed && len(s.conns) == 0 && s.producersDone >= s.want {
		s.endedOnce.Do(func() { close(s.ended) })
	}
}

// add registers a new connection; false when the session takes no more
// (it has ended, or the image was sealed complete at CRIU's post-dump).
func (s *session) add(c *net.UnixConn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-s.ended:
		return false
	default:
	}
	if s.sealed || s.err != nil {
		return false
	}
	s.conns[c] = connUnknown
	s.notifyLocked()
	return true
}

func (s *session) identify(c *net.UnixConn, k connKind) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.conns[c] = k
	switch k {
	case connCRIU:
		s.criuSeen = true
	case connProducer:
		s.producersSeen++
	}
	s.notifyLocked()
}

// closed records the end of a connection; clean means it ended between
// requests (EOF), as a finished CRIU or producer does.
func (s *session) closed(c *net.UnixConn, k connKind, clean bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.conns, c)
	switch k {
	case connCRIU:
		s.criuClosed = true
	case connProducer:
		if clean {
			s.producersDone++
		}
	}
	s.checkEndedLocked()
	s.notifyLocked()
}

// producersOpen counts producer connections still open, and connections
// not yet identified (they may be producers).
func (s *session) producersOpen() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, k := range s.conns {
		if k != connCRIU {
			n++
		}
	}
	return n
}

// acceptLoop takes connections until the listener closes (the session
// ended, failed or ctx was cancelled) and runs handle for each on its own
// goroutine.
func (s *session) acceptLoop(ctx context.Context, l *dirListener, handle func(*net.UnixConn)) {
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	go func() {
		select {
		case <-s.ended:
			l.Close()
		case <-ctx.Done():
		}
	}()
	for {
		conn, err := l.AcceptUnix()
		if err != nil {
			select {
			case <-s.ended:
			default:
				if ctx.Err() == nil {
					s.abort(fmt.Errorf("accept: %w", err))
				}
			}
			return
		}
		if !s.add(conn) {
			conn.Close() // too late: the image is complete
			continue
		}
		s.handlers.Add(1)
		go func() {
			defer s.handlers.Done()
			handle(conn)
		}()
	}
}

// run moves one pipe on its own goroutine.
func (s *session) run(p *os.File, move func(*os.File) error) {
	s.mu.Lock()
	s.pipes[p] = struct{}{}
	s.mu.Unlock()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		err := move(p)
		s.mu.Lock()
		delete(s.pipes, p)
		s.notifyLocked()
		s.mu.Unlock()
		p.Close()
		if err != nil {
			s.abort(err)
		}
	}()
}

// finish waits for every connection handler and every pipe and returns the
// first error.
func (s *session) finish() error {
	s.handlers.Wait()
	s.wg.Wait()
	s.fail(nil)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.connectTimer != nil {
		s.connectTimer.Stop()
	}
	return s.err
}

// readConn reads the requests of one connection and hands each to file,
// after sorting out who is on it: a connection whose first request is a
// producer hello (ProducerHello) is a producer's, any other CRIU's. It
// records the connection's end in the session.
func (s *session) readConn(ctx context.Context, conn *net.UnixConn, onCRIU func(), file func(kind connKind, name string) error) connKind {
	var pos atomic.Int64
	rd := countingReader{conn, &pos}
	kind := connUnknown
	clean := false
	who := ""
	fail := func(err error) {
		if ctx.Err() == nil {
			if who != "" {
				err = fmt.Errorf("producer %q: %w", who, err)
			}
			s.abort(err)
		}
	}
	for {
		name, err := ReadRequest(rd, pos.Load())
		if errors.Is(err, io.EOF) {
			clean = true
			break
		}
		if err != nil {
			fail(err)
			break
		}
		if producer, ok := ParseProducerHello(name); ok {
			if kind != connUnknown {
				s.abort(fmt.Errorf("producer hello %q at socket offset %d: not the first request of its connection", producer, pos.Load()))
				break
			}
			kind, who = connProducer, producer
			s.identify(conn, kind)
			// The producer waits for this before its first request.
			if err := WriteReply(conn, true); err != nil {
				if ctx.Err() == nil {
					s.abort(fmt.Errorf("producer %q: hello reply: %w", producer, err))
				}
				break
			}
			continue
		}
		if kind == connUnknown {
			kind = connCRIU
			s.identify(conn, kind)
			if onCRIU != nil {
				onCRIU()
			}
		}
		if err := file(kind, name); err != nil {
			fail(err)
			break
		}
	}
	s.closed(conn, kind, clean)
	conn.Close()
	return kind
}

// DumpResult says what one dump delivered.
type DumpResult struct {
	Files int
	Bytes int64
	// Complete is true when CRIU sent inventory.img, which it writes last.
	Complete bool
	// Producers is the number of producer connections that pushed files;
	// ProducerFiles and ProducerBytes count what they pushed (also in
	// Files and Bytes).
	Producers     int
	ProducerFiles int
	ProducerBytes int64
}

// IntakeOptions configure an intake.
type IntakeOptions struct {
	Hooks Hooks
	// Producers is the number of producer connections the image waits for:
	// it is not complete (Drained and Wait do not return) until that many
	// have connected and closed cleanly. Producers that connect in time are
	// waited for in any case.
	Producers int
	// ConnectTimeout bounds the wait for CRIU to connect: zero means
	// DefaultConnectTimeout, negative no limit. Past it the intake fails
	// with ErrNoCRIU.
	ConnectTimeout time.Duration
	// Carry names files to carry in the checkpoint (carry.go) beside
	// DefaultCarry: taken when CRIU connects, or at the end of the dump
	// if they appear later; one missing then fails the dump.
	Carry []string
}

// IntakeSession takes the images of one `criu dump --stream`, and the files
// of any producers connected beside it, into a streamer.Capture. It listens
// on DIR/streamer-capture.sock from the moment StartIntakeWith returns.
//
// Completion rule: the image is complete when CRIU has sent inventory.img,
// every producer connection (at least IntakeOptions.Producers of them) has
// closed cleanly (between requests), and every pipe of every connection
// has been read to its end. Producers must connect before that moment
// (in practice: before CRIU's dump ends); a connection that comes later is
// closed unread.
type IntakeSession struct {
	c         *streamer.Capture
	files     atomic.Int64
	bytes     atomic.Int64
	pfiles    atomic.Int64
	pbytes    atomic.Int64
	inventory atomic.Bool // inventory.img requested by CRIU: it opens it last
	carry     *carrier

	mu   sync.Mutex
	sess *session
	done chan struct{}
	err  error
}

// StartIntakeWith listens and serves CRIU's connection (and producers') in
// the background.
func StartIntakeWith(ctx context.Context, dir string, c *streamer.Capture, o IntakeOptions) (*IntakeSession, error) {
	path := filepath.Join(dir, CaptureSocket)
	l, err := listen(dir, CaptureSocket)
	if err != nil {
		return nil, err
	}
	if o.Hooks.Listening != nil {
		o.Hooks.Listening()
	}
	in := &IntakeSession{c: c, done: make(chan struct{}), carry: newCarrier(dir, o.Carry)}
	s, sctx := newSession(ctx, o.Producers)
	s.limitConnectWait(o.ConnectTimeout, path)
	in.sess = s
	go func() {
		defer close(in.done)
		err := in.run(ctx, sctx, s, l, path, o.Hooks)
		in.mu.Lock()
		in.err = err
		in.mu.Unlock()
	}()
	return in, nil
}

func (in *IntakeSession) run(ctx, sctx context.Context, s *session, l *dirListener, path string, hooks Hooks) error {
	// A pipeline failure (storage down, disk full) must reach CRIU now, not
	// when it next writes.
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		select {
		case <-in.c.Done():
			// Done also closes after a normal commit; only an error aborts.
			if err := in.c.Err(); err != nil {
				s.abort(fmt.Errorf("capture pipeline: %w", err))
			}
		case <-sctx.Done():
		}
	}()
	s.acceptLoop(sctx, l, func(conn *net.UnixConn) { in.handle(sctx, s, conn, hooks) })
	err := s.finish()
	<-watched
	if err != nil {
		return fmt.Errorf("dump intake: %w", err)
	}
	if err := s.endErr(ctx, path); err != nil || !in.inventory.Load() {
		return err // a dump that did not finish: the caller says so
	}
	return in.carry.take(in.c, true)
}

// endErr is the error of a session that stopped without an error of its
// own: nil if it ended by the rules, else why it was cut short.
func (s *session) endErr(ctx context.Context, path string) error {
	select {
	case <-s.ended:
		return nil
	default:
	}
	if ctx.Err() == nil {
		return nil
	}
	s.mu.Lock()
	seen := s.criuSeen
	s.mu.Unlock()
	if !seen {
		return fmt.Errorf("waiting for criu on %s: %w", path, context.Cause(ctx))
	}
	return fmt.Errorf("on %s: %w", path, context.Cause(ctx))
}

func (in *IntakeSession) handle(ctx context.Context, s *session, conn *net.UnixConn, hooks Hooks) {
	kind := s.readConn(ctx, conn, in.onConnect(s, hooks), func(kind connKind, name string) error {
		if kind == connProducer && name == "inventory.img" {
			return errors.New("a producer sent inventory.img: that name is CRIU's (it marks the end of the dump)")
		}
		p, err := RecvPipe(conn, name)
		if err != nil {
			return err
		}
		pipeline.GrowPipe(p.Fd())
		external := kind == connProducer
		s.run(p, func(p *os.File) error {
			n, err := in.c.WriteFile(name, p, external)
			if err != nil {
				if external {
					return fmt.Errorf("producer file %s: %w", name, err)
				}
				return fmt.Errorf("image %s: %w", name, err)
			}
			in.files.Add(1)
			in.bytes.Add(n)
			if external {
				in.pfiles.Add(1)
				in.pbytes.Add(n)
			}
			return nil
		})
		if kind == connCRIU && name == "inventory.img" {
			in.inventory.Store(true)
		}
		return nil
	})
	if kind == connCRIU && !in.inventory.Load() && s.producersOpen() > 0 {
		// CRIU gave up: do not keep waiting for producers of a dump that
		// failed.
		s.abort(errors.New("criu disconnected without sending inventory.img (the dump failed); producers cut off"))
	}
}

func (in *IntakeSession) result() DumpResult {
	in.sess.mu.Lock()
	producers := in.sess.producersSeen
	in.sess.mu.Unlock()
	return DumpResult{Files: int(in.files.Load()), Bytes: in.bytes.Load(), Complete: in.inventory.Load(),
		Producers: producers, ProducerFiles: int(in.pfiles.Load()), ProducerBytes: in.pbytes.Load()}
}

// Drained waits until the image is complete by the completion rule (CRIU
// has sent inventory.img, its last image; every producer has closed
// cleanly; every pipe has been read to its end) while CRIU may still hold
// the socket: the moment of CRIU's post-dump action, when the checkpoint
// must be committed before the process is killed. From then on no producer
// is taken: the image is sealed.
func (in *IntakeSession) Drained(ctx context.Context) (DumpResult, error) {
	s := in.sess
	for {
		select {
		case <-in.done:
			return in.Wait(ctx)
		default:
		}
		s.mu.Lock()
		ch := s.changed
		if s.err != nil {
			err := s.err
			s.mu.Unlock()
			return in.result(), fmt.Errorf("dump intake: %w", err)
		}
		ready := in.inventory.Load() && len(s.pipes) == 0 && s.producersDone >= s.want
		for _, k := range s.conns {
			if k != connCRIU {
				ready = false // a producer still pushing, or a connection not yet known
			}
		}
		if ready {
			s.sealed = true
		}
		s.mu.Unlock()
		if ready {
			// Files the caller put into the images dir during the dump.
			if err := in.carry.take(in.c, true); err != nil {
				return in.result(), err
			}
			return in.result(), nil
		}
		select {
		case <-ch:
		case <-in.done:
		case <-ctx.Done():
			return in.result(), context.Cause(ctx)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Wait waits until CRIU and every producer have closed their connections
// and every pipe is drained.
func (in *IntakeSession) Wait(ctx context.Context) (DumpResult, error) {
	select {
	case <-in.done:
	case <-ctx.Done():
		return in.result(), context.Cause(ctx)
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.result(), in.err
}

// Abort makes CRIU's dump fail now: its pipes and socket, and every
// producer's, are closed.
func (in *IntakeSession) Abort(err error) {
	in.sess.abort(err)
}

// IntakeWith listens on DIR/streamer-capture.sock for one `criu dump
// --stream` (and any producers beside it) and writes every image it sends
// into c. It returns when CRIU and the producers have closed the socket and
// every pipe is drained, or at the first error (after closing CRIU's pipes
// so that the dump fails instead of hanging).
func IntakeWith(ctx context.Context, dir string, c *streamer.Capture, o IntakeOptions) (DumpResult, error) {
	in, err := StartIntakeWith(ctx, dir, c, o)
	if err != nil {
		return DumpResult{}, err
	}
	return in.Wait(ctx)
}
