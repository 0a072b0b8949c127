// Package tcp is the live-migration transport: authentication, the
// sender (an Output of the pipeline) and the receiver (a Source). Package
// wire holds its bytes; docs/MIGRATION.md describes the protocol.
//
// One package, not a sender's and a receiver's (the wire format alone
// moved out, to package wire): the two halves share the channel set-up,
// the proofs and the pre-authentication limits, and each alone would
// export most of what the other needs.
package tcp

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"math/big"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/transport/tcp/wire"
	"golang.org/x/sys/unix"
)

const (
	alpnProto = "gpucr-stream/1"
	// MaxStreams bounds --streams.
	MaxStreams = wire.MaxStreams
	// DefaultTCPTimeout is how long a silent peer or a dead link is
	// tolerated.
	DefaultTCPTimeout = 20 * time.Second
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

// ReadTokenFile reads a shared secret: the file's content without
// surrounding white space, at least 16 bytes.
func ReadTokenFile(path string) ([]byte, error) {
	b, err := crypt.ReadSecretFile(path, 1<<20)
	if err != nil {
		return nil, fmt.Errorf("token file %w", err)
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

// MinTokenBits is the least estimated entropy a shared secret must have.
// A peer that is not ours can get material for an offline guess (whoever
// proves first gives one to whoever it talks to), so the token must be
// too strong to guess offline; `gpucr-stream token` makes 256 bits. The
// estimate charges a random secret a few bits for the patterns it holds by
// chance (a run such as "4567"), so a random 128-bit secret passes 112.
const MinTokenBits = 112

// TokenBits estimates a secret's entropy in bits, the way a guesser that
// tries patterns before brute force would count them: the cheapest reading
// of the secret as a chain of pieces, each a character of its alphabet
// (log2 of the alphabet), a run with a fixed step in ASCII or along a
// keyboard row ("1234", "fedc", "aaaa", "!@#$", "qwer"), a repeat of
// earlier text, or, in a secret with spaces, a pronounceable word (a bit a
// letter, about what English text holds, a bit for the word and one for the
// separator after it: a sentence needs some 130 characters, random words
// alike). Only the first 256 bytes are read: what they hold is a lower
// bound for the whole.
func TokenBits(tok []byte) int {
	if len(tok) > 256 {
		tok = tok[:256]
	}
	n := len(tok)
	if n == 0 {
		return 0
	}
	lit := alphabetBits(tok)
	// Words are read only in text: random secrets hold no spaces, and
	// letters in them form "words" by chance.
	text := bytes.IndexByte(tok, ' ') >= 0
	// cost[i]: the cheapest reading of tok[:i].
	cost := make([]float64, n+1)
	for i := 1; i <= n; i++ {
		cost[i] = cost[i-1] + lit
		for j := i - 2; j >= 0; j-- {
			cost[i] = min(cost[i], cost[j]+pieceBits(tok, j, i, lit, text))
		}
	}
	return int(cost[n])
}

// pieceBits is what tok[j:i] costs read as one pattern (+Inf where it is
// none); lit is one character's cost.
func pieceBits(tok []byte, j, i int, lit float64, text bool) float64 {
	piece := tok[j:i]
	c := math.Inf(1)
	if text {
		// Short words only with the space after them ("on ").
		if w, sep := wordLike(piece); w && (len(piece) >= minPattern || piece[len(piece)-1] == ' ') {
			c = float64(len(piece)-sep) + float64(sep) + 1
		}
	}
	if len(piece) < minPattern {
		return c
	}
	if isRun(piece) {
		// first character, length, step and direction
		c = min(c, lit+math.Log2(float64(len(piece)))+3)
	}
	if j > 0 && bytes.Contains(tok[:j], piece) {
		// where it was and how long
		c = min(c, math.Log2(float64(j))+math.Log2(float64(len(piece)))+1)
	}
	return c
}

// minPattern is the shortest piece TokenBits reads as a pattern: shorter
// ones occur by chance in any random secret.
const minPattern = 4

// alphabetBits is log2 of the alphabet tok's characters come from: the
// classes it uses (lower, upper, digits, the rest), or hex digits.
func alphabetBits(tok []byte) float64 {
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
	if hexOnly {
		return 4
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
	return math.Log2(float64(alphabet))
}

// keyboardRows are the rows of a US keyboard, unshifted and shifted, for
// runs such as "qwer" and "!@#$".
var keyboardRows = []string{"`1234567890-=", "~!@#$%^&*()_+", "qwertyuiop[]\\", "QWERTYUIOP{}|", "asdfghjkl;'", "ASDFGHJKL:\"", "zxcvbnm,./", "ZXCVBNM<>?"}

// isRun says whether p steps by one fixed amount (-2..2) in ASCII or by
// one key along a keyboard row.
func isRun(p []byte) bool {
	d := int(p[1]) - int(p[0])
	if d >= -2 && d <= 2 {
		run := true
		for k := 2; k < len(p) && run; k++ {
			run = int(p[k])-int(p[k-1]) == d
		}
		if run {
			return true
		}
	}
	for _, row := range keyboardRows {
		if strings.Contains(row, string(p)) || strings.Contains(reverse(row), string(p)) {
			return true
		}
	}
	return false
}

func reverse(s string) string {
	b := []byte(s)
	for i, j := 0, len(b)-1; i < j; i, j = i+1, j-1 {
		b[i], b[j] = b[j], b[i]
	}
	return string(b)
}

// wordLike says whether p reads as a word of a natural language: letters
// (an apostrophe inside), a vowel for every four, never five consonants
// in a row; sep is 1 where one separator (space, -, _, ., ,) ends it.
func wordLike(p []byte) (ok bool, sep int) {
	if strings.IndexByte(" -_.,", p[len(p)-1]) >= 0 {
		p, sep = p[:len(p)-1], 1
	}
	if len(p) < 2 {
		return false, 0
	}
	vowels, run := 0, 0
	for k, c := range p {
		l := c | 0x20
		switch {
		case strings.IndexByte("aeiouy", l) >= 0:
			vowels, run = vowels+1, 0
		case l >= 'a' && l <= 'z':
			if run++; run > 4 {
				return false, 0
			}
		case c == '\'' && k > 0 && k < len(p)-1:
		default:
			return false, 0
		}
	}
	return 4*vowels >= len(p), sep
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
		keyPEM, err := crypt.ReadSecretFile(keyFile, 1<<20)
		if err != nil {
			return a, fmt.Errorf("--tls-key file %w", err)
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

// helloProof is the sender's proof: over the hello's first 32 bytes (all
// but the proof itself).
func helloProof(token, exporter, hello []byte) [32]byte {
	return proof(token, "client", exporter, hello[:32])
}

// replyProof is the receiver's proof: over the whole hello and the reply's
// first 16 bytes.
func replyProof(token, exporter, hello, reply []byte) [32]byte {
	return proof(token, "server", exporter, hello, reply[:16])
}

// channel is one connection once TLS is up.
type channel struct {
	tc  *tls.Conn
	exp []byte // binds the token proofs to this channel
	// br reads records. Smaller than a DATA record: record payloads are
	// read straight into the caller's buffer instead of through this one.
	br *bufio.Reader
}

// openChannel is what both sides run first on a new connection: TLS
// (server or client side), its bytes counted into in and out, under a
// deadline of timeout that also honours ctx until stop is called. A nil
// channel means the handshake failed; a channel with an error, that it is
// not TLS 1.3.
func openChannel(ctx context.Context, raw net.Conn, cfg *tls.Config, server bool, in, out *atomic.Int64, timeout time.Duration) (ch *channel, stop func(), err error) {
	cc := countConn{Conn: raw, in: in, out: out}
	tc := tls.Client(cc, cfg)
	if server {
		tc = tls.Server(cc, cfg)
	}
	stop = ctxDeadline(ctx, raw, timeout)
	if err := tc.HandshakeContext(ctx); err != nil {
		return nil, stop, err
	}
	exp, err := exporterOf(tc)
	return &channel{tc: tc, exp: exp, br: bufio.NewReaderSize(tc, 64<<10)}, stop, err
}

func exporterOf(tc *tls.Conn) ([]byte, error) {
	cs := tc.ConnectionState()
	if cs.Version != tls.VersionTLS13 {
		return nil, fmt.Errorf("TLS version %#x, want 1.3", cs.Version)
	}
	return cs.ExportKeyingMaterial(wire.ExporterLabel, nil, 32)
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
