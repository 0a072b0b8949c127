package criusock

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
)

// ServeResult says what one restore asked for.
type ServeResult struct {
	Requests int
	Served   int
	Bytes    int64
	// Producers is the number of producer connections that pulled files.
	Producers int
	// ClosedEarly counts the files whose pipe the reader closed before
	// taking all of it, while its connection was still open: its choice
	// (see ServeWith). They are not counted in Served.
	ClosedEarly int
	// Sparse is the zero bytes of pages images left out, their pages
	// restored untouched (sparse.go).
	Sparse int64
}

// ServeOptions configure Serve.
type ServeOptions struct {
	Hooks Hooks
	// Producers is the number of producer connections serving waits for:
	// it does not end until that many have connected and closed cleanly.
	Producers int
	// ConnectTimeout is IntakeOptions.ConnectTimeout for the restore.
	ConnectTimeout time.Duration
	// MemoryLimit is --memory-limit (0: pipeline.DefaultMemoryLimit): the
	// images CRIU reads as files (asfile.go) are memfds up to a quarter of
	// it together, beyond that unlinked files in SpillDir ($TMPDIR when
	// empty).
	MemoryLimit int64
	SpillDir    string
}

// Serve listens on DIR/streamer-serve.sock for one `criu restore --stream`
// and answers its requests from src: absent images get exists=false, the
// others are copied into the pipe CRIU sends, each on its own goroutine.
// A file asked for twice is served twice. Producers (a hello first, see
// ProducerHello) may connect beside CRIU and pull files the same way; the
// serve ends once CRIU and every producer have closed their connections
// and every pipe is written.
func Serve(ctx context.Context, dir string, src source.Source, hooks Hooks) (ServeResult, error) {
	return ServeWith(ctx, dir, src, ServeOptions{Hooks: hooks})
}

// ErrOutstanding means the reader of a file closed its connection with
// that file not taken whole: it gave up (or, on a restore whose CRIU
// succeeded, decided so just before it exited; criusock.Restore lets
// CRIU's exit code decide).
var ErrOutstanding = errors.New("disconnected with a file it asked for not taken whole")

// ServeWith is Serve with options.
//
// Pages images are served sparse (sparse.go) unless GPUCR_NO_SPARSE=1.
// The images CRIU reads as files, not pipes, are handed to it as files
// (asfile.go). A file whose pipe CRIU closes before it has taken all of it
// is CRIU's decision (it skips the rest of a pages-N.img it does not
// restore page by page): the file is
// logged with the bytes not taken and the serve goes on. Only if the
// connection that asked for it is already gone does it fail the serve
// (ErrOutstanding): then CRIU gave up rather than chose. The serve learns
// of a close at its next write to the pipe, so a CRIU that closes a file
// and exits at once may be judged as one that gave up; criusock.Restore,
// which has CRIU's exit code, lets that decide.
func ServeWith(ctx context.Context, dir string, src source.Source, o ServeOptions) (ServeResult, error) {
	path := filepath.Join(dir, ServeSocket)
	l, err := listen(dir, ServeSocket)
	if err != nil {
		return ServeResult{}, err
	}
	if o.Hooks.Listening != nil {
		o.Hooks.Listening()
	}
	s, sctx := newSession(ctx, o.Producers)
	s.limitConnectWait(o.ConnectTimeout, path)
	sv := newServer(s, src, o)
	s.acceptLoop(sctx, l, func(conn *net.UnixConn) { sv.handle(sctx, conn) })
	err = s.finish()
	res := sv.result()
	if err != nil {
		return res, fmt.Errorf("restore serving: %w", err)
	}
	if err := s.endErr(ctx, path); err != nil {
		return res, fmt.Errorf("restore serving: %w", err)
	}
	return res, nil
}

// server answers the requests of one restore's socket (ServeWith), from
// every connection on it.
type server struct {
	s   *session
	src source.Source // what is served: sparse, unless that is off
	// sparse serves pages images without their zero pages; nil when off.
	sparse *sparse
	files  *fileImages // the images CRIU reads as files
	hooks  Hooks

	requests, served, closedEarly, bytes atomic.Int64
}

func newServer(s *session, src source.Source, o ServeOptions) *server {
	sv := &server{s: s, src: src, hooks: o.Hooks}
	if !noSparse {
		sv.sparse = newSparse(src, o.Hooks.Log)
		sv.src = sv.sparse
	}
	sv.files = newFileImages(sv.src, o)
	return sv
}

// handle answers the requests of one connection.
func (sv *server) handle(ctx context.Context, conn *net.UnixConn) {
	sv.s.readConn(ctx, conn, sv.hooks.Connected, func(kind connKind, name string) error {
		return sv.request(ctx, conn, kind, name)
	})
}

// request answers one request for the named file on conn: an image CRIU
// reads as a file is handed over as one, any other that exists is copied
// into the pipe its reader sends, on a goroutine of the session's.
func (sv *server) request(ctx context.Context, conn *net.UnixConn, kind connKind, name string) error {
	sv.requests.Add(1)
	f, err := sv.src.Stat(ctx, name)
	exists := err == nil
	if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return fmt.Errorf("image %s: %w", name, err)
	}
	var omit []source.Span
	if exists && kind == connCRIU {
		var done bool
		if done, omit, err = sv.files.answer(ctx, conn, name, f.Size); done || err != nil {
			if err == nil {
				sv.served.Add(1)
				sv.bytes.Add(f.Size)
			}
			return err
		}
	}
	if err := WriteReply(conn, exists); err != nil {
		return fmt.Errorf("reply for %s: %w", name, err)
	}
	if !exists {
		return nil
	}
	p, err := RecvPipe(conn, name)
	if err != nil {
		return err
	}
	pipeline.GrowPipe(p.Fd())
	sv.s.run(p, func(p *os.File) error { return sv.copy(ctx, conn, p, name, f.Size, omit) })
	return nil
}

// copy writes the named file, size bytes but omit, into p, the pipe of a
// reader on conn. A reader that closes p before it took it all, while
// conn is open, chose to: that is logged, not an error.
func (sv *server) copy(ctx context.Context, conn *net.UnixConn, p *os.File, name string, size int64, omit []source.Span) error {
	n, err := copyOmitting(ctx, sv.src, name, p, omit)
	if err != nil && ctx.Err() == nil && (readerGone(p) || errors.Is(err, syscall.EPIPE)) {
		// Copy counts whole chunks written, so this is exact when the
		// reader took nothing (the usual case) and never more than the
		// file.
		left := min(size, size-n+unread(p))
		if peerGone(conn) {
			return fmt.Errorf("serve %s: %w (%d of %d bytes not taken)", name, ErrOutstanding, left, size)
		}
		sv.closedEarly.Add(1)
		sv.hooks.log(fmt.Sprintf("%s: closed by its reader with %d of %d bytes not taken; serving the rest", name, left, size))
		return nil
	}
	if err != nil {
		return fmt.Errorf("serve %s: %w", name, err)
	}
	sv.served.Add(1)
	sv.bytes.Add(n)
	return nil
}

// result is what the serve did, once its session finished.
func (sv *server) result() ServeResult {
	res := ServeResult{Requests: int(sv.requests.Load()), Served: int(sv.served.Load()), Bytes: sv.bytes.Load(),
		ClosedEarly: int(sv.closedEarly.Load())}
	if sv.sparse != nil {
		res.Sparse = sv.sparse.Omitted()
	}
	sv.s.mu.Lock()
	res.Producers = sv.s.producersSeen
	sv.s.mu.Unlock()
	return res
}
