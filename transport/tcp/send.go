package tcp

import (
	"bufio"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/transport/tcp/wire"
)

// SendOptions configure a sender.
type SendOptions struct {
	Auth Auth
	// Streams is the number of parallel connections (shards), 1..MaxStreams.
	Streams int
	// Timeout bounds the connection set-up and how long a dead link or a
	// silent receiver is tolerated. Zero: DefaultTCPTimeout.
	Timeout time.Duration
	// AutoCommit sends COMMIT as soon as the receiver has acknowledged the
	// stream (capture, checkpoint: they cannot tell when the source process
	// is gone). Off, the caller sends it with Confirm once it is (migrate).
	AutoCommit bool
	// Format is what the stream is written as (sealed, chunk hashes).
	Format pipeline.Format
}

// CommitInfo travels with COMMIT.
type CommitInfo struct {
	// LeftRunning: the source process was left running (a copy, not a move).
	LeftRunning bool `json:"left_running"`
	// GPUs are the manifest's GPU records (CUDA processes suspended for the
	// dump): a multi-stream checkpoint carries no manifest, and the
	// receiver needs them to restore the GPU state (--gpu-map).
	GPUs []manifest.GPU `json:"gpus,omitempty"`
	// CUDA are the manifest's records of the path each CUDA process's
	// device memory took: a receiver restores the VRAM files of those that
	// took the fast path after the driver's restore (migrate).
	CUDA []manifest.CUDAProcess `json:"cuda,omitempty"`
}

// AckInfo travels with ACK: what the receiver verified.
type AckInfo struct {
	Files    int   `json:"files"`
	RawBytes int64 `json:"raw_bytes"`
	// PIDSpace names the receiver's PID space (ListenOptions.PIDSpace).
	PIDSpace string `json:"pid_space,omitempty"`
}

// Report is the receiver's last word: the restored PID, or why not.
type Report struct {
	PID         int     `json:"pid,omitempty"`
	Served      int     `json:"served,omitempty"`
	RestoreSecs float64 `json:"restore_seconds,omitempty"`
	// RunningSecs is how long the restored process had run when the
	// report left: a restore with lazy pages reports once the last page
	// is in, and the process runs before that.
	RunningSecs float64 `json:"running_seconds,omitempty"`
	Error       string  `json:"error,omitempty"`
}

// ReceiverInfo is what the receiver announced in its reply.
type ReceiverInfo struct {
	// Reports: it sends a Report after serving or restoring.
	Reports bool
	// Restores: it runs the restore itself (receive --restore).
	Restores bool
	// ChunkCache: it keeps chunks sent ahead of the stream (SendChunk).
	ChunkCache bool
}

// Output is a streamer.Output that writes one stream over N TLS
// connections to a receiver. Its Commit returns only once the receiver
// has acknowledged that every shard ended and the whole stream verified,
// which is what makes it safe to let CRIU kill the source process then.
type Output struct {
	addr    string
	opts    SendOptions
	session [16]byte
	info    ReceiverInfo
	conns   []*sendConn
	out     *streamer.StreamOutput
	wireIn  atomic.Int64
	wireOut atomic.Int64

	failOnce sync.Once
	failed   chan struct{}
	err      error
	onFail   atomic.Pointer[func(error)]

	// refs are the chunks sent ahead (SendChunk), which the stream's DATA
	// frames reference; nextChunk spreads them over the connections.
	refMu     sync.Mutex
	refs      map[[32]byte]refChunk
	nextChunk int
	refBytes  atomic.Int64

	mu        sync.Mutex
	acked     bool
	committed bool
	aborted   bool
}

type sendItem struct {
	typ uint8
	buf []byte // header room + data for DATA
}

// sendConn is one connection: an asynchronous writer (the pipeline's writer
// hands bytes over and goes on; a goroutine per connection encrypts and
// sends, so N connections use N cores) and a reader of the receiver's
// records.
type sendConn struct {
	o     *Output
	idx   int
	tc    *tls.Conn
	br    *bufio.Reader
	wmu   sync.Mutex
	queue chan sendItem
	free  chan []byte
	cur   []byte
	wdone chan struct{}
	// written counts stream bytes handed to this connection.
	written int64

	acked    chan struct{}
	ackOnce  sync.Once
	ack      AckInfo
	reports  chan Report
	rdone    chan struct{}
	readErr  error
	queueEnd sync.Once
}

const (
	sendBufSize  = 256 << 10
	sendBufCount = 16
)

// DefaultStreams is how many connections a sender opens when not told:
// half the cores, 4 to 8. Each stream is written and encrypted on its
// own goroutine; over loopback with TLS, 8 streams carried a fast-path
// migration's 11.6 GB in 2.5-2.9 s against 3.7-3.9 s with 4 (one H200
// host, 16 cores), and an NCCL pair's 17.3 GB in 3.2 s against 4.7-5.0 s
// (two H200s, 32 cores). More were not measured.
func DefaultStreams() int { return min(8, max(4, runtime.NumCPU()/2)) }

// Dial connects the N streams to the receiver at addr (host:port),
// authenticates both ways and returns the output. Nothing of the
// checkpoint has been sent when it returns; a refusal is an error wrapping
// ErrRefused, with the receiver's reason.
func Dial(ctx context.Context, addr string, o SendOptions) (*Output, error) {
	if err := o.Auth.Check(); err != nil {
		return nil, err
	}
	if o.Streams <= 0 {
		o.Streams = 1
	}
	if o.Streams > MaxStreams {
		return nil, fmt.Errorf("--streams %d: at most %d", o.Streams, MaxStreams)
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTCPTimeout
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("tcp://%s: want tcp://HOST:PORT: %w", addr, err)
	}
	cfg, err := o.Auth.clientConfig(host)
	if err != nil {
		return nil, err
	}
	t := &Output{addr: addr, opts: o, failed: make(chan struct{})}
	if _, err := rand.Read(t.session[:]); err != nil {
		return nil, err
	}
	t.conns = make([]*sendConn, o.Streams)
	infos := make([]ReceiverInfo, o.Streams)
	errs := make([]error, o.Streams)
	var wg sync.WaitGroup
	for i := range o.Streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t.conns[i], infos[i], errs[i] = t.dial(ctx, cfg, i)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		for _, c := range t.conns {
			if c != nil {
				c.tc.Close()
			}
		}
		// One message is enough when every stream says the same.
		for _, e := range errs {
			if e != nil {
				return nil, e
			}
		}
	}
	t.info = infos[0]
	ws := make([]io.Writer, len(t.conns))
	for i, c := range t.conns {
		ws[i] = c
		go c.writeLoop()
		go c.readLoop()
	}
	out, err := streamer.NewStreamOutputAs(ws, o.Format)
	if err != nil {
		t.Close()
		return nil, err
	}
	t.out = out
	return t, nil
}

// Retries of a stream's connection that was refused or reset before the
// receiver answered: a receiver not listening yet, or one that dropped it
// under a flood of unauthenticated peers (preauth.go).
const (
	dialAttempts   = 5
	dialRetryFirst = 100 * time.Millisecond // then doubled
)

// dial connects stream idx, retrying a connection refused or reset before
// the receiver answered, all within the timeout.
func (t *Output) dial(ctx context.Context, cfg *tls.Config, idx int) (*sendConn, ReceiverInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, t.opts.Timeout)
	defer cancel()
	delay := dialRetryFirst
	for attempt := 1; ; attempt++ {
		c, info, err := t.dialOnce(ctx, cfg, idx)
		if err == nil || !retryable(err) {
			return c, info, err
		}
		if attempt == dialAttempts {
			return c, info, fmt.Errorf("%w (%d attempts)", err, attempt)
		}
		select {
		case <-time.After(delay):
		case <-ctx.Done():
			return c, info, fmt.Errorf("%w (%d attempts in --net-timeout %v)", err, attempt, t.opts.Timeout)
		}
		delay *= 2
	}
}

// retryable says err is a connection refused or cut before the receiver
// answered: worth another try. A receiver's refusal, a failed proof or a
// timeout is not.
func retryable(err error) bool {
	for _, e := range []error{syscall.ECONNREFUSED, syscall.ECONNRESET, syscall.EPIPE, io.EOF, io.ErrUnexpectedEOF} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

func (t *Output) dialOnce(ctx context.Context, cfg *tls.Config, idx int) (*sendConn, ReceiverInfo, error) {
	var info ReceiverInfo
	d := net.Dialer{Timeout: t.opts.Timeout, KeepAliveConfig: keepAlive(t.opts.Timeout), Control: userTimeout(t.opts.Timeout)}
	raw, err := d.DialContext(ctx, "tcp", t.addr)
	if err != nil {
		return nil, info, fmt.Errorf("connect to receiver %s: %w", t.addr, err)
	}
	ch, done, err := openChannel(ctx, raw, cfg, false, &t.wireIn, &t.wireOut, t.opts.Timeout)
	fail := func(err error) (*sendConn, ReceiverInfo, error) {
		done()
		raw.Close()
		return nil, info, err
	}
	if ch == nil {
		return fail(fmt.Errorf("TLS handshake with receiver %s: %w: %w", t.addr, err, ErrRefused))
	}
	if err != nil {
		return fail(fmt.Errorf("receiver %s: %w", t.addr, err))
	}
	tc, br := ch.tc, ch.br
	h := wire.Hello{Shard: uint16(idx), Count: uint16(t.opts.Streams), Session: t.session}
	if !t.opts.AutoCommit {
		h.Flags |= 1
	}
	h.Proof = helloProof(t.opts.Auth.Token, ch.exp, h.Marshal())
	hb := h.Marshal()
	if _, err := tc.Write(hb); err != nil {
		return fail(fmt.Errorf("send hello to receiver %s: %w", t.addr, err))
	}
	rep, fixed, err := wire.ReadReply(br)
	if err != nil {
		return fail(fmt.Errorf("receiver %s: %w", t.addr, err))
	}
	if rep.Refused {
		return fail(fmt.Errorf("receiver %s refused the connection: %s: %w", t.addr, rep.Message, ErrRefused))
	}
	if len(t.opts.Auth.Token) > 0 {
		want := replyProof(t.opts.Auth.Token, ch.exp, hb, fixed)
		if !hmac.Equal(want[:], rep.Proof[:]) {
			return fail(fmt.Errorf("receiver %s did not prove that it holds the token (a different --token-file there, or not our receiver); nothing was sent: %w", t.addr, ErrRefused))
		}
	}
	done()
	info = ReceiverInfo{Reports: rep.Flags&wire.ReplyReports != 0, Restores: rep.Flags&wire.ReplyRestores != 0,
		ChunkCache: rep.Flags&wire.ReplyChunkCache != 0}
	c := &sendConn{
		o: t, idx: idx, tc: tc, br: br,
		queue: make(chan sendItem, sendBufCount+2), free: make(chan []byte, sendBufCount),
		wdone: make(chan struct{}), acked: make(chan struct{}), reports: make(chan Report, 1), rdone: make(chan struct{}),
	}
	for range sendBufCount {
		c.free <- make([]byte, wire.RecHeaderSize, wire.RecHeaderSize+sendBufSize)
	}
	return c, info, nil
}

// Format is what the stream is written as.
func (t *Output) Format() pipeline.Format { return t.out.Format() }

// Session is the migration's id, for logs.
func (t *Output) Session() string { return hex.EncodeToString(t.session[:8]) }

// Receiver says what the receiver announced.
func (t *Output) Receiver() ReceiverInfo { return t.info }

// OnFailure registers f to run (once, on its own goroutine) when a
// connection fails during the transfer, so that the capture can stop CRIU
// at once instead of at its next write.
func (t *Output) OnFailure(f func(error)) { t.onFail.Store(&f) }

// Err is the failure that stopped the transfer, if any.
func (t *Output) Err() error {
	select {
	case <-t.failed:
		return t.err
	default:
		return nil
	}
}

func (t *Output) fail(err error) {
	t.failOnce.Do(func() {
		t.err = err
		close(t.failed)
		for _, c := range t.conns {
			c.tc.NetConn().Close()
		}
		if f := t.onFail.Load(); f != nil {
			go (*f)(err)
		}
	})
}

// Write hands stream bytes to the connection's writer goroutine.
func (c *sendConn) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		if c.cur == nil {
			select {
			case b := <-c.free:
				c.cur = b[:wire.RecHeaderSize]
			case <-c.o.failed:
				return n, c.o.err
			}
		}
		k := copy(c.cur[len(c.cur):cap(c.cur)], p)
		c.cur = c.cur[:len(c.cur)+k]
		p = p[k:]
		n += k
		if len(c.cur) == cap(c.cur) {
			if err := c.push(); err != nil {
				return n, err
			}
		}
	}
	c.written += int64(n)
	return n, nil
}

func (c *sendConn) push() error {
	if c.cur == nil || len(c.cur) == wire.RecHeaderSize {
		return nil
	}
	select {
	case c.queue <- sendItem{typ: wire.RecData, buf: c.cur}:
		c.cur = nil
		return nil
	case <-c.o.failed:
		return c.o.err
	}
}

func (c *sendConn) writeLoop() {
	defer close(c.wdone)
	for it := range c.queue {
		var err error
		c.wmu.Lock()
		switch {
		case it.typ == wire.RecData && it.buf != nil:
			wire.PutRecordHeader(it.buf, wire.RecData, len(it.buf)-wire.RecHeaderSize)
			_, err = c.tc.Write(it.buf)
		default:
			err = wire.WriteRecord(c.tc, it.typ, it.buf)
		}
		c.wmu.Unlock()
		if err != nil {
			c.o.fail(fmt.Errorf("stream %d to %s: %w", c.idx, c.o.addr, err))
			return
		}
		if it.typ == wire.RecData && it.buf != nil {
			c.free <- it.buf[:wire.RecHeaderSize]
		}
	}
}

// finish sends what is buffered and the EOS record, and waits until the
// writer goroutine has handed everything to the connection.
func (c *sendConn) finish() error {
	if err := c.push(); err != nil {
		return err
	}
	select {
	case c.queue <- sendItem{typ: wire.RecEOS}:
	case <-c.o.failed:
		return c.o.err
	}
	c.queueEnd.Do(func() { close(c.queue) })
	select {
	case <-c.wdone:
	case <-c.o.failed:
	}
	return c.o.Err()
}

func (c *sendConn) readLoop() {
	defer close(c.rdone)
	for {
		h, p, err := wire.ReadRecord(c.br, false)
		if err != nil {
			c.readErr = err
			c.o.mu.Lock()
			acked := c.o.acked
			c.o.mu.Unlock()
			if !acked {
				if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
					err = errors.New("the receiver closed the connection")
				}
				c.o.fail(fmt.Errorf("stream %d to %s: %w", c.idx, c.o.addr, err))
			}
			return
		}
		switch h.Type {
		case wire.RecAck:
			var a AckInfo
			_ = json.Unmarshal(p, &a)
			c.ackOnce.Do(func() { c.ack = a; close(c.acked) })
		case wire.RecNak:
			c.o.fail(fmt.Errorf("receiver %s rejected the checkpoint: %s", c.o.addr, wire.Printable(string(p))))
			c.readErr = errors.New("rejected")
			return
		case wire.RecReport:
			var r Report
			if err := json.Unmarshal(p, &r); err != nil {
				r.Error = "unreadable report from the receiver"
			}
			r.Error = wire.Printable(r.Error)
			select {
			case c.reports <- r:
			default:
			}
		}
	}
}

// WriteFrame implements streamer.Output.
func (t *Output) WriteFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (streamer.FramePos, error) {
	if err := t.Err(); err != nil {
		return streamer.FramePos{}, err
	}
	if loc, ok := t.refFrame(fh, payload); ok {
		written := make(chan error, 1)
		loc2, err := t.out.WriteRefAsync(ctx, fh, func(err error) { written <- err })
		if err != nil {
			return streamer.FramePos{}, err
		}
		if err := <-written; err != nil {
			return streamer.FramePos{}, err
		}
		loc.Segment, loc.Pos = loc2.Segment, loc2.Pos
		return loc, nil
	}
	return t.out.WriteFrame(ctx, fh, payload)
}

// WriteFrameAsync implements streamer.AsyncOutput: each connection's
// shard is written on a goroutine of its own (see streamer.StreamOutput),
// so the streams copy in parallel.
func (t *Output) WriteFrameAsync(ctx context.Context, fh *manifest.FrameHeader, payload []byte, done func(error)) (streamer.FramePos, error) {
	if err := t.Err(); err != nil {
		return streamer.FramePos{}, err
	}
	if loc, ok := t.refFrame(fh, payload); ok {
		loc2, err := t.out.WriteRefAsync(ctx, fh, done)
		loc.Segment, loc.Pos = loc2.Segment, loc2.Pos
		return loc, err
	}
	return t.out.WriteFrameAsync(ctx, fh, payload, done)
}

// Commit ends every shard and waits until the receiver has acknowledged
// the whole stream as received and verified. With AutoCommit it then also
// sends COMMIT.
func (t *Output) Commit(ctx context.Context, m *manifest.Manifest) error {
	if err := t.out.Commit(ctx, m); err != nil {
		if e := t.Err(); e != nil {
			return e
		}
		return err
	}
	var wg sync.WaitGroup
	errs := make([]error, len(t.conns))
	for i, c := range t.conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = c.finish()
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return t.Err()
	}
	// What was sent is in the kernel's buffers; the receiver decodes as it
	// reads, so its verdict follows the last bytes closely.
	wait := time.NewTimer(2 * t.opts.Timeout)
	defer wait.Stop()
	for _, c := range t.conns {
		select {
		case <-c.acked:
		case <-t.failed:
			return t.err
		case <-ctx.Done():
			err := fmt.Errorf("waiting for the receiver's acknowledgement: %w", context.Cause(ctx))
			t.fail(err)
			return err
		case <-wait.C:
			err := fmt.Errorf("receiver %s did not acknowledge the checkpoint within %v", t.addr, 2*t.opts.Timeout)
			t.fail(err)
			return err
		}
	}
	t.mu.Lock()
	t.acked = true
	t.mu.Unlock()
	if t.opts.AutoCommit {
		if err := t.Confirm(ctx, CommitInfo{GPUs: m.GPUs, CUDA: m.CUDA}); err != nil {
			return err
		}
		for _, c := range t.conns {
			closeWrite(c.tc)
		}
	}
	return nil
}

// Acked says what the receiver verified.
func (t *Output) Acked() AckInfo { return t.conns[0].ack }

// Confirm tells the receiver that the checkpoint is committed on this side
// (the source process is gone, or was left running): it may restore.
func (t *Output) Confirm(ctx context.Context, info CommitInfo) error {
	t.mu.Lock()
	if !t.acked {
		t.mu.Unlock()
		return errors.New("confirm before the receiver acknowledged the checkpoint")
	}
	if t.aborted {
		t.mu.Unlock()
		return errors.New("confirm after abort")
	}
	t.committed = true
	t.mu.Unlock()
	b, _ := json.Marshal(info)
	c := t.conns[0]
	c.wmu.Lock()
	defer c.wmu.Unlock()
	stop := ctxDeadline(ctx, c.tc.NetConn(), t.opts.Timeout)
	defer stop()
	if err := wire.WriteRecord(c.tc, wire.RecCommit, b); err != nil {
		return fmt.Errorf("tell receiver %s to restore: %w", t.addr, err)
	}
	return nil
}

// WaitReport waits for the receiver's report after Confirm.
func (t *Output) WaitReport(ctx context.Context) (Report, error) {
	c := t.conns[0]
	select {
	case r := <-c.reports:
		return r, nil
	case <-c.rdone:
		select {
		case r := <-c.reports:
			return r, nil
		default:
		}
		err := c.readErr
		if errors.Is(err, io.EOF) {
			err = errors.New("the receiver closed the connection")
		}
		return Report{}, fmt.Errorf("no report from receiver %s: %w", t.addr, err)
	case <-ctx.Done():
		return Report{}, fmt.Errorf("waiting for receiver %s: %w", t.addr, context.Cause(ctx))
	}
}

// Sizes returns the stream bytes sent on each connection.
func (t *Output) Sizes() []int64 { return t.out.Sizes() }

// WireBytes is what went over the network: TLS records, protocol records
// and stream bytes (TCP/IP headers not counted).
func (t *Output) WireBytes() int64 { return t.wireOut.Load() }

// Abort tells the receiver to discard what it got (unless the checkpoint
// was already committed) and closes the connections.
func (t *Output) Abort(ctx context.Context) error {
	t.Cancel("capture failed")
	return nil
}

// Cancel aborts with a reason the receiver logs. It does nothing after
// Confirm.
func (t *Output) Cancel(reason string) {
	t.mu.Lock()
	if t.committed || t.aborted {
		t.mu.Unlock()
		return
	}
	t.aborted = true
	t.mu.Unlock()
	if t.out != nil {
		// The shards' writes in progress end once their bytes are queued
		// on the connections; on a link that stopped moving, the closed
		// connections end them (and say the abort).
		stuck := time.AfterFunc(2*time.Second, func() { t.fail(fmt.Errorf("aborted: %s", reason)) })
		_ = t.out.Abort(context.Background())
		stuck.Stop()
	}
	if t.Err() == nil {
		var wg sync.WaitGroup
		for _, c := range t.conns {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// The writer goroutine may be inside a DATA record; the
				// ABORT goes after it, or the closed connection says it.
				_ = c.tc.NetConn().SetWriteDeadline(time.Now().Add(2 * time.Second))
				c.wmu.Lock()
				_ = wire.WriteRecord(c.tc, wire.RecAbort, []byte(reason))
				c.wmu.Unlock()
			}()
		}
		wg.Wait()
	}
	t.fail(fmt.Errorf("aborted: %s", reason))
}

// Close closes every connection.
func (t *Output) Close() error {
	for _, c := range t.conns {
		if c != nil {
			c.tc.NetConn().Close()
		}
	}
	return nil
}
