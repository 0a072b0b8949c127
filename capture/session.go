package capture

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

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/streamer"
)

// Hooks report the protocol's milestones (criu-image-streamer's progress
// lines). Any of them may be nil.
type Hooks struct {
	// Listening runs once the socket accepts connections: CRIU may start.
	Listening func()
	// Connected runs when CRIU connects.
	Connected func()
}

// session is one CRIU connection and the pipes it opened. Every pipe is
// moved by its own goroutine, since CRIU keeps many open at once and
// writes or reads them in an order of its own.
type session struct {
	conn  *net.UnixConn
	pos   atomic.Int64 // bytes of requests read, for error offsets
	wg    sync.WaitGroup
	mu    sync.Mutex
	pipes map[*os.File]struct{}
	err   error
	fail  context.CancelCauseFunc
	// onIdle runs after each pipe finishes.
	onIdle func()
}

func (s *session) open() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.pipes)
}

func (s *session) failed() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
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

// accept waits for CRIU on the socket at path; ctx aborts the wait.
func accept(ctx context.Context, path string, hooks Hooks) (*net.UnixConn, error) {
	l, err := listen(path)
	if err != nil {
		return nil, err
	}
	if hooks.Listening != nil {
		hooks.Listening()
	}
	return acceptOn(ctx, l, path, hooks)
}

// acceptOn takes one connection and closes the listener: one CRIU run per
// socket.
func acceptOn(ctx context.Context, l *net.UnixListener, path string, hooks Hooks) (*net.UnixConn, error) {
	defer l.Close()
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	conn, err := l.AcceptUnix()
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("waiting for criu on %s: %w", path, context.Cause(ctx))
		}
		return nil, fmt.Errorf("accept on %s: %w", path, err)
	}
	if hooks.Connected != nil {
		hooks.Connected()
	}
	return conn, nil
}

func newSession(ctx context.Context, conn *net.UnixConn) (*session, context.Context) {
	ctx, cancel := context.WithCancelCause(ctx)
	s := &session{conn: conn, pipes: map[*os.File]struct{}{}, fail: cancel}
	// On failure close everything CRIU holds the other end of, so that it
	// sees EPIPE or EOF at once and gives up (resuming the dumped process).
	context.AfterFunc(ctx, func() {
		conn.Close()
		s.mu.Lock()
		defer s.mu.Unlock()
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
		s.mu.Unlock()
		p.Close()
		if err != nil {
			s.abort(err)
		}
		if s.onIdle != nil {
			s.onIdle()
		}
	}()
}

// finish waits for every pipe and returns the first error.
func (s *session) finish() error {
	s.wg.Wait()
	s.fail(nil)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// DumpResult says what one dump delivered.
type DumpResult struct {
	Files int
	Bytes int64
	// Complete is true when CRIU sent inventory.img, which it writes last.
	Complete bool
}

// IntakeSession takes the images of one `criu dump --stream` into a
// streamer.Capture. It listens on DIR/streamer-capture.sock from the moment
// StartIntake returns.
type IntakeSession struct {
	c         *streamer.Capture
	files     atomic.Int64
	bytes     atomic.Int64
	inventory atomic.Bool // inventory.img requested: CRIU opens it last

	mu      sync.Mutex
	sess    *session
	changed chan struct{} // closed and replaced when pipes finish
	done    chan struct{}
	err     error
}

// StartIntake listens and serves one CRIU connection in the background.
func StartIntake(ctx context.Context, dir string, c *streamer.Capture, hooks Hooks) (*IntakeSession, error) {
	path := filepath.Join(dir, CaptureSocket)
	l, err := listen(path)
	if err != nil {
		return nil, err
	}
	if hooks.Listening != nil {
		hooks.Listening()
	}
	in := &IntakeSession{c: c, changed: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(in.done)
		err := in.run(ctx, l, path, hooks)
		in.mu.Lock()
		in.err = err
		in.mu.Unlock()
	}()
	return in, nil
}

func (in *IntakeSession) run(ctx context.Context, l *net.UnixListener, path string, hooks Hooks) error {
	conn, err := acceptOn(ctx, l, path, hooks)
	if err != nil {
		return err
	}
	s, sctx := newSession(ctx, conn)
	s.onIdle = in.notify
	in.mu.Lock()
	in.sess = s
	in.mu.Unlock()
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
	rd := countingReader{conn, &s.pos}
	for {
		name, err := ReadRequest(rd, s.pos.Load())
		if err == io.EOF {
			break
		}
		if err != nil {
			if sctx.Err() == nil {
				s.abort(err)
			}
			break
		}
		p, err := RecvPipe(conn, name)
		if err != nil {
			if sctx.Err() == nil {
				s.abort(err)
			}
			break
		}
		streamer.GrowPipe(p.Fd())
		s.run(p, func(p *os.File) error {
			n, err := in.c.WriteFile(name, p, false)
			if err != nil {
				return fmt.Errorf("image %s: %w", name, err)
			}
			in.files.Add(1)
			in.bytes.Add(n)
			return nil
		})
		if name == "inventory.img" {
			in.inventory.Store(true)
		}
	}
	err = s.finish()
	<-watched
	conn.Close()
	if err != nil {
		return fmt.Errorf("dump intake: %w", err)
	}
	return nil
}

func (in *IntakeSession) notify() {
	in.mu.Lock()
	close(in.changed)
	in.changed = make(chan struct{})
	in.mu.Unlock()
}

func (in *IntakeSession) result() DumpResult {
	return DumpResult{Files: int(in.files.Load()), Bytes: in.bytes.Load(), Complete: in.inventory.Load()}
}

// Drained waits until CRIU has sent inventory.img (its last image) and every
// pipe it opened has been read to its end, while CRIU may still hold the
// socket: the moment of CRIU's post-dump action, when the checkpoint must be
// committed before the process is killed.
func (in *IntakeSession) Drained(ctx context.Context) (DumpResult, error) {
	for {
		in.mu.Lock()
		ch, sess := in.changed, in.sess
		in.mu.Unlock()
		select {
		case <-in.done:
			return in.Wait(ctx)
		default:
		}
		if sess != nil && in.inventory.Load() && sess.open() == 0 {
			if err := sess.failed(); err != nil {
				return in.result(), fmt.Errorf("dump intake: %w", err)
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

// Wait waits until CRIU has closed the socket and every pipe is drained.
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

// Abort makes CRIU's dump fail now: its pipes and socket are closed.
func (in *IntakeSession) Abort(err error) {
	in.mu.Lock()
	s := in.sess
	in.mu.Unlock()
	if s != nil {
		s.abort(err)
	}
}

// Intake listens on DIR/streamer-capture.sock for one `criu dump --stream`
// and writes every image it sends into c. It returns when CRIU has closed
// the socket and every pipe is drained, or at the first error (after
// closing CRIU's pipes so that the dump fails instead of hanging).
func Intake(ctx context.Context, dir string, c *streamer.Capture, hooks Hooks) (DumpResult, error) {
	in, err := StartIntake(ctx, dir, c, hooks)
	if err != nil {
		return DumpResult{}, err
	}
	return in.Wait(ctx)
}

// ServeResult says what one restore asked for.
type ServeResult struct {
	Requests int
	Served   int
	Bytes    int64
}

// Serve listens on DIR/streamer-serve.sock for one `criu restore --stream`
// and answers its requests from src: absent images get exists=false, the
// others are copied into the pipe CRIU sends, each on its own goroutine.
// A file asked for twice is served twice.
func Serve(ctx context.Context, dir string, src streamer.Source, hooks Hooks) (ServeResult, error) {
	var res ServeResult
	conn, err := accept(ctx, filepath.Join(dir, ServeSocket), hooks)
	if err != nil {
		return res, err
	}
	s, sctx := newSession(ctx, conn)
	var served atomic.Int64
	var bytes atomic.Int64
	rd := countingReader{conn, &s.pos}
	for {
		name, err := ReadRequest(rd, s.pos.Load())
		if err == io.EOF {
			break
		}
		if err != nil {
			if sctx.Err() == nil {
				s.abort(err)
			}
			break
		}
		res.Requests++
		_, err = src.Stat(sctx, name)
		exists := err == nil
		if err != nil && !errors.Is(err, streamer.ErrNotExist) {
			s.abort(fmt.Errorf("image %s: %w", name, err))
			break
		}
		if err := WriteReply(conn, exists); err != nil {
			if sctx.Err() == nil {
				s.abort(fmt.Errorf("reply for %s: %w", name, err))
			}
			break
		}
		if !exists {
			continue
		}
		p, err := RecvPipe(conn, name)
		if err != nil {
			if sctx.Err() == nil {
				s.abort(err)
			}
			break
		}
		streamer.GrowPipe(p.Fd())
		s.run(p, func(p *os.File) error {
			n, err := src.Copy(sctx, name, p)
			if err != nil {
				return fmt.Errorf("serve %s: %w", name, err)
			}
			served.Add(1)
			bytes.Add(n)
			return nil
		})
	}
	err = s.finish()
	conn.Close()
	res.Served, res.Bytes = int(served.Load()), bytes.Load()
	if err != nil {
		return res, fmt.Errorf("restore serving: %w", err)
	}
	return res, nil
}

// WriteExtract writes every file of src into dir (for sources that are not
// extracting on their own), each through a temporary name.
func WriteExtract(ctx context.Context, src streamer.Source, dir string) (int, int64, error) {
	files, err := src.Files(ctx)
	if err != nil {
		return 0, 0, err
	}
	var total int64
	for _, f := range files {
		n, err := writeFileAtomic(ctx, src, dir, f)
		if err != nil {
			return 0, total, err
		}
		total += n
	}
	return len(files), total, nil
}

func writeFileAtomic(ctx context.Context, src streamer.Source, dir string, f manifest.File) (int64, error) {
	if !ValidImageName(f.Name) {
		return 0, fmt.Errorf("extract: unsafe file name %q", f.Name)
	}
	tmp, err := os.CreateTemp(dir, "."+f.Name+".partial-*")
	if err != nil {
		return 0, fmt.Errorf("extract %s: %w", f.Name, err)
	}
	n, err := src.Copy(ctx, f.Name, tmp)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), filepath.Join(dir, f.Name))
	}
	if err != nil {
		os.Remove(tmp.Name())
		return n, fmt.Errorf("extract %s: %w", f.Name, err)
	}
	return n, nil
}
