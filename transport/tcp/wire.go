// Package tcp is the live-migration transport: its wire format,
// authentication, the sender (an Output of the pipeline) and the receiver
// (a Source). docs/MIGRATION.md describes the protocol.
package tcp

// The TCP transport carries one checkpoint stream from a sender (capture,
// checkpoint, migrate) to a receiver (receive, serve/restore --from tcp://)
// over N parallel connections, one shard of the stream each. It is never
// open to the network: every connection is TLS 1.3, and each side proves
// that it holds the shared token with an HMAC over the TLS exporter, so the
// proof is bound to that one channel (a captured proof is worth nothing on
// another connection, and a man in the middle holds two channels with two
// exporters). Certificates (--tls-cert/--tls-key/--tls-ca) can replace or
// complement the token.
//
// Per connection, after the TLS handshake:
//
//	sender -> receiver  hello (64 bytes, below)
//	receiver -> sender  reply (50 bytes + refusal text)
//	sender -> receiver  records: DATA... EOS               the shard's bytes
//	receiver -> sender  ACK (or NAK)     every shard ended and the whole stream verified
//	sender -> receiver  COMMIT (or ABORT), connection 0    the source process is gone
//	receiver -> sender  REPORT, connection 0               restored PID, or why not
//
// Hello: "GPUCRMIG", u16 version (1), u16 flags, u16 shard index, u16 shard
// count, 16-byte session id, 32-byte proof = HMAC-SHA256(token, "gpucr-stream
// migrate v1 client" || exporter || hello[0:32]).
//
// Reply: "GPUCRMIG", u16 version, u16 status (0 accepted, 1 refused), u32
// flags (1: the receiver reports, 2: it restores), 32-byte proof =
// HMAC-SHA256(token, "gpucr-stream migrate v1 server" || exporter || hello ||
// reply[0:16]) (zero when refused), u16 length and the refusal text.
//
// Record: u8 type, 3 zero bytes, u32 length, then length bytes. All
// integers are little-endian. The exporter is 32 bytes of
// ExportKeyingMaterial("EXPORTER-gpucr-stream-migrate", nil, 32).

import (
	"bufio"
	"bytes"
	"compress/flate"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"math/big"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

const (
	tcpMagic      = "GPUCRMIG"
	tcpVersion    = 1
	helloSize     = 64
	replyFixed    = 50
	maxRefusal    = 1024
	exporterLabel = "EXPORTER-gpucr-stream-migrate"
	alpnProto     = "gpucr-stream/1"
	// MaxStreams bounds --streams.
	MaxStreams = 64

	recHeaderSize    = 8
	maxDataRecord    = 1 << 20
	maxControlRecord = 64 << 10

	// DefaultTCPTimeout is how long a silent peer or a dead link is
	// tolerated.
	DefaultTCPTimeout = 20 * time.Second
)

// Record types. Sender to receiver: data, eos, abort, commit; receiver to
// sender: ack, nak, report.
const (
	recData   = 1
	recEOS    = 2
	recAbort  = 3
	recCommit = 4
	recAck    = 16
	recNak    = 17
	recReport = 18
)

// Reply flags.
const (
	replyReports  = 1
	replyRestores = 2
)

// ErrRefused marks a peer that failed authentication or spoke something
// other than this protocol.
var ErrRefused = errors.New("refused")

// Auth is what a peer must prove: the shared token, certificates signed
// by a trusted CA, or both.
type Auth struct {
	// Token is the shared secret; nil means none.
	Token []byte
	// Cert is this side's certificate; CAs verifies the peer's.
	Cert *tls.Certificate
	CAs  *x509.CertPool
}

// Check refuses an auth that proves nothing: the TCP path is never open.
func (a Auth) Check() error {
	if len(a.Token) == 0 && (a.Cert == nil || a.CAs == nil) {
		return errors.New("tcp:// needs a shared secret (--token-file, made with `gpucr-stream token > FILE`) or certificates (--tls-cert, --tls-key and --tls-ca)")
	}
	return nil
}

// NewToken returns a fresh shared secret: 32 random bytes in hex.
func NewToken() string {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// MinTokenBits is the least estimated entropy a shared secret must have.
// A peer that is not ours can get material for an offline guess (whoever
// proves first gives one to whoever it talks to), so the token must be
// too strong to guess offline; `gpucr-stream token` makes 256 bits.
const MinTokenBits = 128

// ReadTokenFile reads a shared secret: the file's content without
// surrounding white space, at least 16 bytes and MinTokenBits of
// estimated entropy, from a file no other user can read.
func ReadTokenFile(path string) ([]byte, error) {
	b, err := readSecretFile(path)
	if err != nil {
		return nil, fmt.Errorf("token file: %w", err)
	}
	tok := []byte(strings.TrimSpace(string(b)))
	if len(tok) < 16 {
		return nil, fmt.Errorf("token file %s: the secret is %d bytes, want at least 16 (make one with `gpucr-stream token > FILE`)", path, len(tok))
	}
	if bits := TokenBits(tok); bits < MinTokenBits {
		return nil, fmt.Errorf("token file %s: the secret has about %d bits of entropy, want at least %d (make one with `gpucr-stream token > FILE`)", path, bits, MinTokenBits)
	}
	return tok, nil
}

// readSecretFile reads a file that holds a secret, refusing one that
// other users may read or write: they would hold the secret too.
func readSecretFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("%s holds a secret but other users may read it (mode %04o): chmod 600 %s", path, perm, path)
	}
	return io.ReadAll(io.LimitReader(f, 1<<20))
}

// TokenBits estimates a secret's entropy in bits: its length times the
// bits of the alphabet its characters come from, but no more than its size
// once compressed (a repeated pattern is weak whatever its alphabet).
func TokenBits(tok []byte) int {
	if len(tok) == 0 {
		return 0
	}
	var lower, upper, digit, other, hexOnly = false, false, false, false, true
	for _, c := range tok {
		switch {
		case c >= 'a' && c <= 'z':
			lower = true
		case c >= 'A' && c <= 'Z':
			upper = true
		case c >= '0' && c <= '9':
			digit = true
		default:
			other = true
		}
		if !strings.ContainsRune("0123456789abcdefABCDEF", rune(c)) {
			hexOnly = false
		}
	}
	alphabet := 0
	for _, c := range []struct {
		on bool
		n  int
	}{{lower, 26}, {upper, 26}, {digit, 10}, {other, 32}} {
		if c.on {
			alphabet += c.n
		}
	}
	if hexOnly {
		alphabet = 16
	}
	bits := float64(len(tok)) * math.Log2(float64(alphabet))
	var z bytes.Buffer
	zw, _ := flate.NewWriter(&z, flate.BestCompression)
	zw.Write(tok)
	zw.Close()
	return int(min(bits, float64(8*z.Len())))
}

// LoadAuth reads the token file and certificates; empty names are
// skipped, but certificate flags come as a set.
func LoadAuth(tokenFile, certFile, keyFile, caFile string) (Auth, error) {
	var a Auth
	if tokenFile != "" {
		tok, err := ReadTokenFile(tokenFile)
		if err != nil {
			return a, err
		}
		a.Token = tok
	}
	if certFile != "" || keyFile != "" || caFile != "" {
		if certFile == "" || keyFile == "" || caFile == "" {
			return a, errors.New("certificates need all of --tls-cert, --tls-key and --tls-ca")
		}
		certPEM, err := os.ReadFile(certFile)
		if err != nil {
			return a, fmt.Errorf("--tls-cert: %w", err)
		}
		keyPEM, err := readSecretFile(keyFile)
		if err != nil {
			return a, fmt.Errorf("--tls-key: %w", err)
		}
		cert, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			return a, fmt.Errorf("--tls-cert/--tls-key: %w", err)
		}
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return a, fmt.Errorf("--tls-ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return a, fmt.Errorf("--tls-ca %s: no PEM certificate in it", caFile)
		}
		a.Cert, a.CAs = &cert, pool
	}
	return a, a.Check()
}

var ephemeral struct {
	once sync.Once
	cert tls.Certificate
	err  error
}

// ephemeralCert is this process's self-signed certificate for the token
// mode: TLS needs one, and the token proof (not the certificate)
// authenticates the peer.
func ephemeralCert() (tls.Certificate, error) {
	ephemeral.once.Do(func() {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			ephemeral.err = err
			return
		}
		serial, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
		tmpl := &x509.Certificate{
			SerialNumber: serial,
			Subject:      pkix.Name{CommonName: "gpucr-stream ephemeral"},
			NotBefore:    time.Now().Add(-time.Hour),
			NotAfter:     time.Now().Add(7 * 24 * time.Hour),
			KeyUsage:     x509.KeyUsageDigitalSignature,
			ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
		if err != nil {
			ephemeral.err = err
			return
		}
		ephemeral.cert = tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
	})
	return ephemeral.cert, ephemeral.err
}

func (a Auth) serverConfig() (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS13, NextProtos: []string{alpnProto}}
	if a.Cert != nil {
		cfg.Certificates = []tls.Certificate{*a.Cert}
		cfg.ClientCAs = a.CAs
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	} else {
		c, err := ephemeralCert()
		if err != nil {
			return nil, err
		}
		cfg.Certificates = []tls.Certificate{c}
	}
	return cfg, nil
}

func (a Auth) clientConfig(serverName string) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS13, NextProtos: []string{alpnProto}, ServerName: serverName}
	if a.Cert != nil {
		cfg.Certificates = []tls.Certificate{*a.Cert}
		cfg.RootCAs = a.CAs
	} else {
		// The receiver's certificate is ephemeral; it proves the token
		// over this channel's exporter instead, before any byte is sent.
		cfg.InsecureSkipVerify = true
	}
	return cfg, nil
}

// proof is the HMAC that shows a side holds the token, bound to one TLS
// channel by its exporter.
func proof(token []byte, role string, exporter []byte, msgs ...[]byte) [32]byte {
	var out [32]byte
	if len(token) == 0 {
		return out
	}
	m := hmac.New(sha256.New, token)
	m.Write([]byte("gpucr-stream migrate v1 " + role))
	m.Write(exporter)
	for _, b := range msgs {
		m.Write(b)
	}
	copy(out[:], m.Sum(nil))
	return out
}

func exporterOf(tc *tls.Conn) ([]byte, error) {
	cs := tc.ConnectionState()
	if cs.Version != tls.VersionTLS13 {
		return nil, fmt.Errorf("TLS version %#x, want 1.3", cs.Version)
	}
	return cs.ExportKeyingMaterial(exporterLabel, nil, 32)
}

// hello opens every connection of a sender.
type hello struct {
	Flags   uint16
	Shard   uint16
	Count   uint16
	Session [16]byte
	Proof   [32]byte
}

func (h hello) marshal() []byte {
	b := make([]byte, helloSize)
	copy(b, tcpMagic)
	binary.LittleEndian.PutUint16(b[8:], tcpVersion)
	binary.LittleEndian.PutUint16(b[10:], h.Flags)
	binary.LittleEndian.PutUint16(b[12:], h.Shard)
	binary.LittleEndian.PutUint16(b[14:], h.Count)
	copy(b[16:32], h.Session[:])
	copy(b[32:64], h.Proof[:])
	return b
}

func parseHello(b []byte) (hello, error) {
	var h hello
	if len(b) != helloSize {
		return h, fmt.Errorf("hello of %d bytes, want %d", len(b), helloSize)
	}
	if string(b[:8]) != tcpMagic {
		return h, errors.New("not a gpucr-stream sender (bad hello magic)")
	}
	if v := binary.LittleEndian.Uint16(b[8:]); v != tcpVersion {
		return h, fmt.Errorf("sender speaks protocol version %d; this receiver speaks %d (use the same gpucr-stream version on both sides)", v, tcpVersion)
	}
	h.Flags = binary.LittleEndian.Uint16(b[10:])
	h.Shard = binary.LittleEndian.Uint16(b[12:])
	h.Count = binary.LittleEndian.Uint16(b[14:])
	copy(h.Session[:], b[16:32])
	copy(h.Proof[:], b[32:64])
	if h.Count == 0 || h.Count > MaxStreams || h.Shard >= h.Count {
		return h, fmt.Errorf("hello names stream %d of %d (want 1..%d streams)", h.Shard, h.Count, MaxStreams)
	}
	if h.Session == ([16]byte{}) {
		return h, errors.New("hello with an empty session id")
	}
	return h, nil
}

type reply struct {
	Refused bool
	Flags   uint32
	Proof   [32]byte
	Message string
}

func (r reply) marshal() []byte {
	msg := r.Message
	if len(msg) > maxRefusal {
		msg = msg[:maxRefusal]
	}
	b := make([]byte, replyFixed+len(msg))
	copy(b, tcpMagic)
	binary.LittleEndian.PutUint16(b[8:], tcpVersion)
	if r.Refused {
		binary.LittleEndian.PutUint16(b[10:], 1)
	}
	binary.LittleEndian.PutUint32(b[12:], r.Flags)
	copy(b[16:48], r.Proof[:])
	binary.LittleEndian.PutUint16(b[48:], uint16(len(msg)))
	copy(b[50:], msg)
	return b
}

// readReply reads and checks a reply; fixed is its first replyFixed bytes
// (covered by the receiver's proof).
func readReply(r io.Reader) (rep reply, fixed []byte, err error) {
	fixed = make([]byte, replyFixed)
	if _, err := io.ReadFull(r, fixed); err != nil {
		return rep, nil, fmt.Errorf("no reply from the receiver: %w", err)
	}
	if string(fixed[:8]) != tcpMagic {
		return rep, nil, errors.New("the peer is not a gpucr-stream receiver (bad reply magic)")
	}
	if v := binary.LittleEndian.Uint16(fixed[8:]); v != tcpVersion {
		return rep, nil, fmt.Errorf("receiver speaks protocol version %d, this sender %d", v, tcpVersion)
	}
	switch binary.LittleEndian.Uint16(fixed[10:]) {
	case 0:
	case 1:
		rep.Refused = true
	default:
		return rep, nil, errors.New("reply with an unknown status")
	}
	rep.Flags = binary.LittleEndian.Uint32(fixed[12:])
	copy(rep.Proof[:], fixed[16:48])
	n := int(binary.LittleEndian.Uint16(fixed[48:]))
	if n > maxRefusal {
		return rep, nil, fmt.Errorf("reply message of %d bytes", n)
	}
	msg := make([]byte, n)
	if _, err := io.ReadFull(r, msg); err != nil {
		return rep, nil, fmt.Errorf("reply message: %w", err)
	}
	rep.Message = printable(string(msg))
	return rep, fixed, nil
}

// printable keeps a peer's text from carrying control characters into logs.
func printable(s string) string {
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, s)
}

type recordHeader struct {
	Type uint8
	Len  uint32
}

func putRecordHeader(b []byte, typ uint8, n int) {
	b[0], b[1], b[2], b[3] = typ, 0, 0, 0
	binary.LittleEndian.PutUint32(b[4:], uint32(n))
}

// parseRecordHeader checks a record header against the types one direction
// may carry.
func parseRecordHeader(b []byte, fromSender bool) (recordHeader, error) {
	h := recordHeader{Type: b[0], Len: binary.LittleEndian.Uint32(b[4:])}
	if b[1]|b[2]|b[3] != 0 {
		return h, errors.New("record header with non-zero reserved bytes")
	}
	limit := uint32(maxControlRecord)
	switch h.Type {
	case recData:
		limit = maxDataRecord
		if !fromSender {
			return h, errors.New("DATA record from the receiver")
		}
	case recEOS:
		limit = 0
		if !fromSender {
			return h, errors.New("EOS record from the receiver")
		}
	case recAbort, recCommit:
		if !fromSender {
			return h, fmt.Errorf("record type %d from the receiver", h.Type)
		}
	case recAck, recNak, recReport:
		if fromSender {
			return h, fmt.Errorf("record type %d from the sender", h.Type)
		}
	default:
		return h, fmt.Errorf("unknown record type %d", h.Type)
	}
	if h.Len > limit {
		return h, fmt.Errorf("record type %d of %d bytes (limit %d)", h.Type, h.Len, limit)
	}
	return h, nil
}

// readRecord reads one control record (DATA is streamed by shardReader).
func readRecord(r io.Reader, fromSender bool) (recordHeader, []byte, error) {
	var hb [recHeaderSize]byte
	if _, err := io.ReadFull(r, hb[:]); err != nil {
		return recordHeader{}, nil, err
	}
	h, err := parseRecordHeader(hb[:], fromSender)
	if err != nil {
		return h, nil, err
	}
	if h.Type == recData {
		return h, nil, errors.New("DATA record where a control record belongs")
	}
	p := make([]byte, h.Len)
	if _, err := io.ReadFull(r, p); err != nil {
		return h, nil, fmt.Errorf("record type %d: %w", h.Type, unexpectedEOF(err))
	}
	return h, p, nil
}

func writeRecord(w io.Writer, typ uint8, payload []byte) error {
	b := make([]byte, recHeaderSize+len(payload))
	putRecordHeader(b, typ, len(payload))
	copy(b[recHeaderSize:], payload)
	_, err := w.Write(b)
	return err
}

func unexpectedEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// shardReader gives the bytes of a connection's DATA records as one
// stream, up to the EOS record (io.EOF). The control records that follow
// are read from the same buffered reader.
type shardReader struct {
	br     *bufio.Reader
	left   uint32
	eos    bool
	err    error
	counts *atomic.Int64
	// conn, when set, gets a read deadline of timeout before every read:
	// an authenticated sender that stays connected and silent is dropped
	// like a dead link.
	conn    net.Conn
	timeout time.Duration
}

func (s *shardReader) deadline() {
	if s.conn != nil {
		_ = s.conn.SetReadDeadline(time.Now().Add(s.timeout))
	}
}

// broke describes a failed read, saying so when the sender fell silent.
func (s *shardReader) broke(what string, err error) error {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return fmt.Errorf("%s: the sender sent nothing for %v: %w", what, s.timeout, err)
	}
	return fmt.Errorf("%s: %w", what, unexpectedEOF(err))
}

func (s *shardReader) Read(p []byte) (int, error) {
	for s.left == 0 {
		if s.err != nil {
			return 0, s.err
		}
		if s.eos {
			return 0, io.EOF
		}
		var hb [recHeaderSize]byte
		s.deadline()
		if _, err := io.ReadFull(s.br, hb[:]); err != nil {
			s.err = s.broke("stream ended without its end marker", err)
			return 0, s.err
		}
		h, err := parseRecordHeader(hb[:], true)
		if err != nil {
			s.err = err
			return 0, err
		}
		switch h.Type {
		case recData:
			s.left = h.Len
		case recEOS:
			s.eos = true
		case recAbort:
			msg := make([]byte, h.Len)
			if _, err := io.ReadFull(s.br, msg); err != nil {
				s.err = fmt.Errorf("sender aborted: %w", unexpectedEOF(err))
			} else {
				s.err = fmt.Errorf("sender aborted: %s", printable(string(msg)))
			}
		default:
			s.err = fmt.Errorf("record type %d inside the stream", h.Type)
		}
	}
	if uint32(len(p)) > s.left {
		p = p[:s.left]
	}
	s.deadline()
	n, err := s.br.Read(p)
	s.left -= uint32(n)
	if s.counts != nil {
		s.counts.Add(int64(n))
	}
	if err != nil {
		s.err = s.broke("stream broke", err)
		if n > 0 {
			return n, nil
		}
		return 0, s.err
	}
	return n, nil
}

// drain reads to the EOS record; DATA after the stream's end is an error.
func (s *shardReader) drain() error {
	var b [1]byte
	for !s.eos {
		n, err := s.Read(b[:])
		if n > 0 {
			return errors.New("data after the end of the stream")
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// countConn counts the bytes on the wire (TLS records included).
type countConn struct {
	net.Conn
	in, out *atomic.Int64
}

func (c countConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.in.Add(int64(n))
	return n, err
}

func (c countConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.out.Add(int64(n))
	return n, err
}

// keepAlive detects a dead link within about timeout, idle or not.
func keepAlive(timeout time.Duration) net.KeepAliveConfig {
	step := max(time.Second, timeout/3)
	return net.KeepAliveConfig{Enable: true, Idle: step, Interval: step, Count: 2}
}

// userTimeout makes unacknowledged data fail the connection after
// timeout, instead of the kernel's retries of a quarter of an hour.
func userTimeout(timeout time.Duration) func(network, address string, c syscall.RawConn) error {
	return func(network, address string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(timeout.Milliseconds()))
		})
		if err != nil {
			return err
		}
		return serr
	}
}

func tuneConn(c net.Conn, timeout time.Duration) {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return
	}
	_ = tc.SetKeepAliveConfig(keepAlive(timeout))
	if rc, err := tc.SyscallConn(); err == nil {
		_ = userTimeout(timeout)("", "", rc)
	}
}

// closeWrite ends a TLS connection's sending side (close_notify, FIN) so
// that the peer reads EOF after what was sent, while replies can still
// arrive.
func closeWrite(tc *tls.Conn) {
	_ = tc.SetWriteDeadline(time.Now().Add(time.Second))
	_ = tc.CloseWrite()
	if cw, ok := tc.NetConn().(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	} else if cc, ok := tc.NetConn().(countConn); ok {
		if t, ok := cc.Conn.(*net.TCPConn); ok {
			_ = t.CloseWrite()
		}
	}
}

// ctxDeadline sets a connection deadline that also honours ctx.
func ctxDeadline(ctx context.Context, c net.Conn, d time.Duration) func() {
	_ = c.SetDeadline(time.Now().Add(d))
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
	return func() {
		stop()
		_ = c.SetDeadline(time.Time{})
	}
}
