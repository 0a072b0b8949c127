package tcp

import (
	"bufio"
	"context"
	"crypto/hmac"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/transport/tcp/wire"
)

// ListenOptions configure a receiver.
type ListenOptions struct {
	Auth Auth
	// Timeout bounds handshakes, the gathering of a sender's streams and
	// how long a dead link or silent sender is tolerated.
	Timeout time.Duration
	// Reports and Restores are announced to the sender (ReceiverInfo).
	Reports, Restores bool
	// PIDSpace names the PID space restores happen in; it travels with the
	// acknowledgement, so that a sender in the same one knows to wait until
	// the source's PIDs are free.
	PIDSpace string
	// Log receives one line per refused peer and per session event.
	Log func(msg string)
	// ChunkCache keeps the chunks a sender sends ahead of its stream
	// (pre-copy, wire/chunk.go): CacheMemory bytes in memory, the rest in
	// SpillDir (empty: $TMPDIR).
	ChunkCache  bool
	CacheMemory int64
	SpillDir    string
}

// Listener accepts one checkpoint: every peer that fails the TLS
// handshake, the hello or the token proof is refused (and told why, where
// it got that far) while the listener goes on waiting for a real sender.
type Listener struct {
	ln      net.Listener
	o       ListenOptions
	cfg     *tls.Config
	wireIn  atomic.Int64
	wireOut atomic.Int64
	once    sync.Once
	// drops logs the peers turned away before authenticating.
	drops *dropLog
}

// Listen listens on addr (host:port; port 0 picks one).
func Listen(ctx context.Context, addr string, o ListenOptions) (*Listener, error) {
	if err := o.Auth.Check(); err != nil {
		return nil, err
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTCPTimeout
	}
	if o.Log == nil {
		o.Log = func(string) {}
	}
	cfg, err := o.Auth.serverConfig()
	if err != nil {
		return nil, err
	}
	lc := net.ListenConfig{KeepAliveConfig: keepAlive(o.Timeout), Control: userTimeout(o.Timeout)}
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", addr, err)
	}
	if a, ok := ln.Addr().(*net.TCPAddr); ok && a.IP.IsUnspecified() {
		o.Log(fmt.Sprintf("warning: listening on every interface (%s): any host that reaches this port can try to connect; name an address (--listen HOST:PORT) to limit that", ln.Addr()))
	}
	return &Listener{ln: ln, o: o, cfg: cfg, drops: newDropLog(o.Log, time.Second, 5)}, nil
}

// Addr is the address listened on.
func (l *Listener) Addr() net.Addr { return l.ln.Addr() }

// Close stops listening.
func (l *Listener) Close() error {
	var err error
	l.once.Do(func() { err = l.ln.Close() })
	return err
}

func (l *Listener) logf(format string, args ...any) { l.o.Log(fmt.Sprintf(format, args...)) }

// recvConn is one authenticated connection of a sender.
type recvConn struct {
	raw  net.Conn
	tc   *tls.Conn
	br   *bufio.Reader
	peer string
	h    wire.Hello
	hb   []byte
	exp  []byte
	sr   *wire.ShardReader
	wmu  sync.Mutex
}

func (c *recvConn) close() { c.raw.Close() }

func (c *recvConn) write(typ uint8, payload []byte, timeout time.Duration) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	_ = c.raw.SetWriteDeadline(time.Now().Add(timeout))
	defer c.raw.SetWriteDeadline(time.Time{})
	return wire.WriteRecord(c.tc, typ, payload)
}

// refuse tells a peer that got through TLS why it is turned away, then
// hangs up.
func refuse(tc *tls.Conn, raw net.Conn, msg string) {
	_ = raw.SetWriteDeadline(time.Now().Add(2 * time.Second))
	_, _ = tc.Write(wire.Reply{Refused: true, Message: msg}.Marshal())
	closeWrite(tc)
	raw.Close()
}

// handshake authenticates one connection. A refused peer is logged, then
// told why (where it got through TLS) and hung up on.
func (l *Listener) handshake(ctx context.Context, raw net.Conn, pre *preAuth) (*recvConn, error) {
	c, tell, err := l.authenticate(ctx, raw, pre)
	if err == nil {
		return c, nil
	}
	err = fmt.Errorf("%w: %w", err, ErrRefused)
	why := "hello refused"
	switch {
	case c == nil:
		why = "TLS handshake failed"
	case tell == noHello:
		why = "no hello"
	}
	l.drops.add(why, fmt.Sprintf("refused %s: %v", raw.RemoteAddr(), err))
	if c != nil {
		refuse(c.tc, raw, tell)
	} else {
		raw.Close()
	}
	return nil, err
}

// authenticate runs TLS and checks the hello; on failure c is set once TLS
// is up, with what to tell the peer.
func (l *Listener) authenticate(ctx context.Context, raw net.Conn, pre *preAuth) (c *recvConn, tell string, err error) {
	tuneConn(raw, l.o.Timeout)
	// A real sender sends its hello right after the TLS handshake, a few
	// round trips: a peer that takes longer is not one.
	end := time.Now().Add(min(l.o.Timeout, preAuthTimeout))
	ch, stop, err := openChannel(ctx, raw, l.cfg, true, &l.wireIn, &l.wireOut, time.Until(end))
	defer stop()
	if ch == nil {
		return nil, "", fmt.Errorf("TLS handshake failed (not a gpucr-stream sender, or one without our certificates): %v", err)
	}
	c = &recvConn{raw: raw, tc: ch.tc, br: ch.br, exp: ch.exp, peer: raw.RemoteAddr().String()}
	if err != nil {
		return c, err.Error(), err
	}
	pre.tlsDone(raw)
	wait := min(time.Until(end), helloTimeout)
	_ = raw.SetReadDeadline(time.Now().Add(wait))
	c.hb = make([]byte, wire.HelloSize)
	if _, err := io.ReadFull(c.br, c.hb); err != nil {
		return c, noHello, fmt.Errorf("no hello within %v of the TLS handshake: %v", wait.Round(time.Millisecond), err)
	}
	if c.h, err = wire.ParseHello(c.hb); err != nil {
		return c, err.Error(), err
	}
	if len(l.o.Auth.Token) > 0 {
		want := helloProof(l.o.Auth.Token, c.exp, c.hb)
		if !hmac.Equal(want[:], c.h.Proof[:]) {
			return c, "authentication failed: the sender's token does not match the receiver's (check --token-file on both sides)",
				errors.New("authentication failed: the sender does not hold our token (wrong --token-file?)")
		}
	}
	return c, "", nil
}

// noHello is what a peer that sent no hello is told.
const noHello = "no hello"

// admit answers an authenticated connection with the receiver's proof.
func (l *Listener) admit(c *recvConn) error {
	r := wire.Reply{}
	if l.o.Reports {
		r.Flags |= wire.ReplyReports
	}
	if l.o.Restores {
		r.Flags |= wire.ReplyRestores
	}
	if l.o.ChunkCache {
		r.Flags |= wire.ReplyChunkCache
	}
	r.Proof = replyProof(l.o.Auth.Token, c.exp, c.hb, r.Marshal())
	_ = c.raw.SetWriteDeadline(time.Now().Add(l.o.Timeout))
	defer c.raw.SetWriteDeadline(time.Time{})
	_, err := c.tc.Write(r.Marshal())
	return err
}

type pendingSession struct {
	count int
	n     int
	conns []*recvConn
	start time.Time
}

func (p *pendingSession) close() {
	for _, c := range p.conns {
		if c != nil {
			c.close()
		}
	}
}

// AcceptSession waits until one sender has connected and authenticated
// all of its streams, refusing every other peer, and stops listening. Until
// then nothing a peer sends is read beyond its hello.
func (l *Listener) AcceptSession(ctx context.Context) (*Session, error) {
	ctx, cancel := context.WithCancel(ctx)
	// Every goroutine started here has returned when AcceptSession does:
	// the accept loop once the listener is closed, the handshakes once ctx
	// is cancelled (their deadlines fire at once).
	defer l.drops.flush(true) // once every handshake has ended
	var wg sync.WaitGroup
	defer wg.Wait()
	defer l.Close()
	defer cancel()
	authenticated := make(chan *recvConn)
	acceptErr := make(chan error, 1)
	wg.Add(1)
	go func() {
		defer wg.Done()
		l.acceptLoop(ctx, &wg, authenticated, acceptErr)
	}()
	pending := map[[16]byte]*pendingSession{}
	defer func() {
		for _, p := range pending {
			p.close()
		}
	}()
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case c := <-authenticated:
			if s := l.join(pending, c); s != nil {
				return s, nil
			}
		case <-tick.C:
			l.drops.flush(false)
			for id, p := range pending {
				if time.Since(p.start) > l.o.Timeout {
					p.close()
					delete(pending, id)
					l.logf("dropped session %s: %d of %d streams connected within %v", hex.EncodeToString(id[:8]), p.n, p.count, l.o.Timeout)
				}
			}
		case err := <-acceptErr:
			return nil, fmt.Errorf("accept: %w", err)
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
	}
}

// acceptLoop accepts connections until the listener closes, and hands
// those that authenticate to authenticated; the others are logged and hung
// up on by handshake. The accept path never waits for a handshake: a peer
// that connects and stays silent holds one slot of its source for at most
// the pre-auth deadline, and is the first to go when its source (or
// everyone) is over the limit (preauth.go). Its handshakes, counted in wg,
// end with ctx.
func (l *Listener) acceptLoop(ctx context.Context, wg *sync.WaitGroup, authenticated chan<- *recvConn, acceptErr chan<- error) {
	pre := newPreAuth(maxPreAuth, maxPreAuthPerSource)
	for {
		raw, err := l.ln.Accept()
		if err != nil {
			acceptErr <- err
			return
		}
		if ev := pre.add(raw); ev != nil {
			l.drops.add("dropped (too many still to authenticate)", fmt.Sprintf("dropped %s: too many connections still to authenticate", ev.RemoteAddr()))
			ev.Close()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := l.handshake(ctx, raw, pre)
			pre.remove(raw)
			if err != nil {
				return
			}
			select {
			case authenticated <- c:
			case <-ctx.Done():
				raw.Close()
			}
		}()
	}
}

// join adds an authenticated connection to its pending session, refusing
// it where it does not fit, and returns the session once all of its
// streams are there.
func (l *Listener) join(pending map[[16]byte]*pendingSession, c *recvConn) *Session {
	p := pending[c.h.Session]
	if p == nil {
		if len(pending) >= 4 {
			l.logf("refused %s: busy with other senders", c.peer)
			refuse(c.tc, c.raw, "busy: other senders are connecting")
			return nil
		}
		p = &pendingSession{count: int(c.h.Count), conns: make([]*recvConn, c.h.Count), start: time.Now()}
		pending[c.h.Session] = p
	}
	switch {
	case int(c.h.Count) != p.count:
		l.logf("refused %s: stream count %d, session has %d", c.peer, c.h.Count, p.count)
		refuse(c.tc, c.raw, "stream count differs from the session's")
		return nil
	case p.conns[c.h.Shard] != nil:
		l.logf("refused %s: stream %d of its session is already connected", c.peer, c.h.Shard)
		refuse(c.tc, c.raw, fmt.Sprintf("stream %d of this session is already connected", c.h.Shard))
		return nil
	}
	if err := l.admit(c); err != nil {
		c.close()
		l.logf("lost %s during the handshake: %v", c.peer, err)
		return nil
	}
	p.conns[c.h.Shard] = c
	p.n++
	if p.n < p.count {
		return nil
	}
	delete(pending, c.h.Session)
	s := &Session{ID: hex.EncodeToString(c.h.Session[:8]), Peer: c.peer, conns: p.conns, timeout: l.o.Timeout, l: l}
	if l.o.ChunkCache {
		s.cache = newChunkCache(l.o.CacheMemory, l.o.SpillDir, len(s.conns))
	}
	for _, c := range s.conns {
		c.sr = wire.NewShardReader(c.br, &s.streamBytes)
		if s.cache != nil {
			c.sr.SetChunkCache(s.cache.put, s.cache.payload, s.cache.begin)
			c.sr.SetChunkAlloc(s.cache.alloc)
		}
		// An authenticated sender that stays connected and silent is
		// dropped like a dead link.
		c.sr.SetIdleTimeout(c.raw, l.o.Timeout)
	}
	l.logf("session %s from %s: %d stream(s) authenticated", s.ID, s.Peer, p.count)
	return s
}

// Session is one sender's authenticated set of streams.
type Session struct {
	ID          string
	Peer        string
	conns       []*recvConn
	timeout     time.Duration
	l           *Listener
	streamBytes atomic.Int64
	closeOnce   sync.Once
	// cache holds the pre-copy rounds' chunks until the stream is read.
	cache       *chunkCache
	cacheOnce   sync.Once
	CacheChunks int
	CacheBytes  int64
}

// freeCache drops the chunk cache, noting what it held.
func (s *Session) freeCache() {
	s.cacheOnce.Do(func() {
		if s.cache != nil {
			s.CacheChunks, s.CacheBytes = s.cache.stats()
			s.cache.close()
		}
	})
}

// AheadBytes counts the stored bytes of the chunks sent ahead of the
// stream (pre-copy rounds) received so far: the stream's counters see
// none of them until the final dump refers to them.
func (s *Session) AheadBytes() int64 {
	if s.cache == nil {
		return 0
	}
	_, n := s.cache.stats()
	return n
}

// Streams is the number of connections (shards).
func (s *Session) Streams() int { return len(s.conns) }

// Readers are the shards' streams, in shard order, with names for errors.
func (s *Session) Readers() ([]io.Reader, []string) {
	rs := make([]io.Reader, len(s.conns))
	names := make([]string, len(s.conns))
	for i, c := range s.conns {
		rs[i] = c.sr
		names[i] = fmt.Sprintf("tcp stream %d from %s", i, s.Peer)
	}
	return rs, names
}

// StreamBytes counts the stream bytes received so far.
func (s *Session) StreamBytes() int64 { return s.streamBytes.Load() }

// WireBytes counts what came over the network, TLS included.
func (s *Session) WireBytes() int64 { return s.l.wireIn.Load() }

func (s *Session) each(f func(c *recvConn) error) error {
	errs := make([]error, len(s.conns))
	var wg sync.WaitGroup
	for i, c := range s.conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = f(c)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Ack tells the sender on every stream that the checkpoint is complete and
// verified.
func (s *Session) Ack(info AckInfo) error {
	b, _ := json.Marshal(info)
	return s.each(func(c *recvConn) error { return c.write(wire.RecAck, b, s.timeout) })
}

// Nak tells the sender that the checkpoint is rejected, and hangs up.
func (s *Session) Nak(msg string) {
	if len(msg) > wire.MaxRefusal {
		msg = msg[:wire.MaxRefusal]
	}
	_ = s.each(func(c *recvConn) error { return c.write(wire.RecNak, []byte(msg), 2*time.Second) })
	s.Close()
}

// WaitCommit waits for the sender's COMMIT after Ack. ABORT, a closed or
// dead connection, or silence beyond the timeouts mean the checkpoint must
// not be restored.
func (s *Session) WaitCommit(ctx context.Context) (CommitInfo, error) {
	var ci CommitInfo
	c := s.conns[0]
	// The sender commits once CRIU has killed the source process and it is
	// gone, bounded on its side by the same timeout.
	stop := ctxDeadline(ctx, c.raw, 3*s.timeout)
	defer stop()
	if err := c.sr.Drain(); err != nil {
		return ci, err
	}
	h, p, err := wire.ReadRecord(c.br, true)
	if err != nil {
		if errors.Is(err, io.EOF) {
			return ci, errors.New("the sender closed the connection")
		}
		if ctx.Err() != nil {
			return ci, context.Cause(ctx)
		}
		return ci, err
	}
	switch h.Type {
	case wire.RecCommit:
		if err := json.Unmarshal(p, &ci); err != nil {
			return ci, fmt.Errorf("unreadable COMMIT: %w", err)
		}
		return ci, nil
	case wire.RecAbort:
		return ci, fmt.Errorf("the sender aborted: %s", wire.Printable(string(p)))
	}
	return ci, fmt.Errorf("record type %d where COMMIT was expected", h.Type)
}

// Report sends the receiver's last word on stream 0 and hangs up.
func (s *Session) Report(r Report) error {
	b, _ := json.Marshal(r)
	err := s.conns[0].write(wire.RecReport, b, s.timeout)
	for _, c := range s.conns {
		closeWrite(c.tc)
	}
	return err
}

// Close hangs up every stream.
func (s *Session) Close() {
	s.closeOnce.Do(func() {
		for _, c := range s.conns {
			c.close()
		}
	})
	s.freeCache()
}

// Source is a checkpoint received over TCP, as a source.Source. It
// decodes and checks the streams as they arrive (files held in memory up to
// the budget, spilled beyond), acknowledges the complete, verified stream to
// the sender, and serves nothing until the sender has committed (its source
// process is gone): a transfer that breaks, a stream that fails a check, or
// a sender that never commits leaves nothing to restore, and what was held
// is dropped at once.
type Source struct {
	l      *Listener
	so     source.StreamSourceOptions
	cancel context.CancelFunc

	started chan struct{} // session accepted
	done    chan struct{} // committed, or failed

	sess        *Session
	stream      *source.StreamSource
	streamClose sync.Once
	err         error
	commit      CommitInfo
	// Times of the milestones, for reports.
	Accepted, Verified, Committed time.Time
}

// NewSource starts receiving on l in the background; l is closed once a
// sender's session is accepted. Canceling ctx with a cause refuses the
// sender with that cause.
func NewSource(ctx context.Context, l *Listener, so source.StreamSourceOptions) *Source {
	ctx, cancel := context.WithCancel(ctx)
	// Files go out only through the gate (an extract writes them with
	// Copy after the commit), never straight from the decoder.
	so.ExtractDir = ""
	s := &Source{l: l, so: so, cancel: cancel, started: make(chan struct{}), done: make(chan struct{})}
	go s.run(ctx)
	return s
}

func (s *Source) run(ctx context.Context) {
	defer close(s.done)
	sess, err := s.l.AcceptSession(ctx)
	if err != nil {
		s.err = err
		return
	}
	s.Accepted = time.Now()
	s.sess = sess
	readers, names := sess.Readers()
	so := s.so
	so.ServeEarly = true
	s.stream = source.NewStreamSource(ctx, readers, names, so)
	close(s.started)
	fail := func(err error) {
		s.err = err
		s.sess.Close()
		s.streamClose.Do(func() { s.stream.Close() }) // drops what was held
	}
	err = s.stream.Wait(ctx)
	sess.freeCache() // every REF is resolved, or none will be
	if err != nil {
		if ctx.Err() != nil {
			err = context.Cause(ctx) // why the receiver gave up, for the sender
		}
		s.sess.Nak(err.Error())
		fail(fmt.Errorf("transfer from %s broke: %w; the partial image is discarded and nothing is restored", sess.Peer, err))
		return
	}
	s.Verified = time.Now()
	files, err := s.stream.Files(ctx)
	if err != nil {
		s.sess.Nak(err.Error())
		fail(err)
		return
	}
	info := AckInfo{PIDSpace: s.l.o.PIDSpace}
	for _, f := range files {
		info.Files++
		info.RawBytes += f.Size
	}
	if err := sess.Ack(info); err != nil {
		fail(fmt.Errorf("acknowledge to %s: %w; the image is discarded and nothing is restored", sess.Peer, err))
		return
	}
	ci, err := sess.WaitCommit(ctx)
	if err != nil {
		fail(fmt.Errorf("the sender did not commit the checkpoint (%w): it is discarded and nothing is restored", err))
		return
	}
	s.Committed = time.Now()
	s.commit = ci
}

// Session is the accepted session (nil until then).
func (s *Source) Session() *Session {
	select {
	case <-s.started:
		return s.sess
	default:
		return nil
	}
}

// Started is closed once a sender's session is accepted.
func (s *Source) Started() <-chan struct{} { return s.started }

// Done is closed when the checkpoint is committed or has failed.
func (s *Source) Done() <-chan struct{} { return s.done }

// WaitCommitted waits until the sender committed; any error means nothing
// may be restored.
func (s *Source) WaitCommitted(ctx context.Context) (CommitInfo, error) {
	select {
	case <-s.done:
	case <-ctx.Done():
		return CommitInfo{}, context.Cause(ctx)
	}
	return s.commit, s.err
}

// Counters are the stream's live totals (nil until a session started).
func (s *Source) Counters() *pipeline.Counters {
	select {
	case <-s.started:
		return &s.stream.Counters
	default:
		return nil
	}
}

// Stat implements source.Source; it waits for the commit.
func (s *Source) Stat(ctx context.Context, name string) (manifest.File, error) {
	if _, err := s.WaitCommitted(ctx); err != nil {
		return manifest.File{}, err
	}
	return s.stream.Stat(ctx, name)
}

// Copy implements source.Source.
func (s *Source) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	if _, err := s.WaitCommitted(ctx); err != nil {
		return 0, err
	}
	return s.stream.Copy(ctx, name, w)
}

// CopyToFile implements source.FileCopier.
func (s *Source) CopyToFile(ctx context.Context, name string, f *os.File) (int64, error) {
	if _, err := s.WaitCommitted(ctx); err != nil {
		return 0, err
	}
	return s.stream.CopyToFile(ctx, name, f)
}

// Files implements source.Source.
func (s *Source) Files(ctx context.Context) ([]manifest.File, error) {
	if _, err := s.WaitCommitted(ctx); err != nil {
		return nil, err
	}
	return s.stream.Files(ctx)
}

// Report sends the receiver's report to the sender (after a commit).
func (s *Source) Report(r Report) error {
	if s.Session() == nil {
		return errors.New("no session")
	}
	return s.sess.Report(r)
}

// Close stops receiving and drops everything held.
func (s *Source) Close() error {
	s.cancel()
	s.l.Close()
	<-s.done
	if s.sess != nil {
		s.sess.Close()
		s.streamClose.Do(func() { s.stream.Close() })
	}
	return nil
}
