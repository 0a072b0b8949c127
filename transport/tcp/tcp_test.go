package tcp

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/testwait"
	"github.com/gpucr/gpucr-stream/transport/tcp/wire"
)

// logBuf collects a listener's log lines.
type logBuf struct {
	mu    sync.Mutex
	lines []string
}

func (l *logBuf) log(s string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, s)
}

func (l *logBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}

// waitLog waits until a log line contains want.
func (l *logBuf) waitLog(t *testing.T, want string) {
	t.Helper()
	deadline := time.Now().Add(testwait.Scale(10 * time.Second))
	for time.Now().Before(deadline) {
		if strings.Contains(l.String(), want) {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no log line with %q in:\n%s", want, l.String())
}

func tokenAuth(s string) Auth { return Auth{Token: []byte(s)} }

const (
	goodToken  = "f8d3e42278ffa37b89b6a07c63c048c94b109045490d663533f2f45cece573dd"
	otherToken = "c42507a72743f066ab012986423285cf201791d5a42f4825b0927c4b4e2e9ecb"
)

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	t.Cleanup(cancel)
	return ctx
}

type receiver struct {
	l   *Listener
	src *Source
	log *logBuf
}

func startReceiver(t *testing.T, auth Auth) *receiver {
	t.Helper()
	return startReceiverTimeout(t, auth, 3*time.Second)
}

// startReceiverTimeout is startReceiver with timeout (--net-timeout).
func startReceiverTimeout(t *testing.T, auth Auth, timeout time.Duration) *receiver {
	t.Helper()
	lb := &logBuf{}
	l, err := Listen(testCtx(t), "127.0.0.1:0", ListenOptions{Auth: auth, Timeout: timeout, Reports: true, Restores: true, Log: lb.log})
	if err != nil {
		t.Fatal(err)
	}
	src := NewSource(testCtx(t), l, source.StreamSourceOptions{Options: pipeline.Options{MemoryLimit: 8 << 20}, SpillDir: t.TempDir()})
	t.Cleanup(func() { src.Close() })
	return &receiver{l: l, src: src, log: lb}
}

func (r *receiver) addr() string { return r.l.Addr().String() }

// testFiles are what a checkpoint holds: small, empty, multi-chunk, zeros.
func testFiles() map[string][]byte {
	big := make([]byte, 5<<20+123)
	rand.Read(big[:3<<20])
	return map[string][]byte{
		"inventory.img": []byte("inventory"),
		"empty.img":     {},
		"pages-1.img":   big,
		"core-1.img":    bytes.Repeat([]byte("core"), 1000),
	}
}

// send writes files through a capture into out and commits.
func send(t testing.TB, out streamer.Output, files map[string][]byte) error {
	t.Helper()
	spec, _ := codec.ParseSpec("lz4")
	c, err := streamer.NewCapture(testCtx(t), out, pipeline.Options{ChunkSize: 1 << 20, Codec: spec})
	if err != nil {
		t.Fatal(err)
	}
	for name, b := range files {
		if _, err := c.WriteFile(name, bytes.NewReader(b), false); err != nil {
			c.Abort(err)
			_, _ = c.Close(testCtx(t), manifest.Manifest{})
			return err
		}
	}
	_, err = c.Close(testCtx(t), manifest.Manifest{})
	return err
}

// transferAll dials r with o, sends testFiles and checks what r serves.
func transferAll(t *testing.T, r *receiver, o SendOptions) {
	t.Helper()
	out, err := Dial(testCtx(t), r.addr(), o)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	files := testFiles()
	if err := send(t, out, files); err != nil {
		t.Fatal(err)
	}
	checkFiles(t, r.src, files)
}

func checkFiles(t testing.TB, src source.Source, files map[string][]byte) {
	t.Helper()
	for name, want := range files {
		var buf bytes.Buffer
		if _, err := src.Copy(testCtx(t), name, &buf); err != nil {
			t.Fatalf("copy %s: %v", name, err)
		}
		if !bytes.Equal(buf.Bytes(), want) {
			t.Fatalf("%s: got %d bytes, want %d", name, buf.Len(), len(want))
		}
	}
}

func TestTCPMigrationRoundTrip(t *testing.T) {
	for _, streams := range []int{1, 3} {
		t.Run(fmt.Sprint(streams), func(t *testing.T) {
			r := startReceiver(t, tokenAuth(goodToken))
			out, err := Dial(testCtx(t), r.addr(), SendOptions{Auth: tokenAuth(goodToken), Streams: streams, Timeout: 3 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			defer out.Close()
			if info := out.Receiver(); !info.Reports || !info.Restores {
				t.Errorf("receiver info %+v", info)
			}
			files := testFiles()
			if err := send(t, out, files); err != nil {
				t.Fatalf("send: %v", err)
			}
			if a := out.Acked(); a.Files != len(files) {
				t.Errorf("ack says %d files, sent %d", a.Files, len(files))
			}
			// Acknowledged but not committed: nothing is served yet.
			ctx, cancel := context.WithTimeout(testCtx(t), 200*time.Millisecond)
			_, err = r.src.Stat(ctx, "inventory.img")
			cancel()
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("stat before commit: %v, want it to wait", err)
			}
			if err := out.Confirm(testCtx(t), CommitInfo{}); err != nil {
				t.Fatal(err)
			}
			if _, err := r.src.WaitCommitted(testCtx(t)); err != nil {
				t.Fatal(err)
			}
			checkFiles(t, r.src, files)
			if got := r.src.Session().Streams(); got != streams {
				t.Errorf("session has %d streams, want %d", got, streams)
			}
			if err := r.src.Report(Report{PID: 4242}); err != nil {
				t.Fatal(err)
			}
			rep, err := out.WaitReport(testCtx(t))
			if err != nil || rep.PID != 4242 {
				t.Fatalf("report %+v, %v", rep, err)
			}
			if out.WireBytes() < int64(len(files["pages-1.img"]))/2 {
				t.Errorf("wire bytes %d", out.WireBytes())
			}
		})
	}
}

func TestTCPAutoCommit(t *testing.T) {
	r := startReceiver(t, tokenAuth(goodToken))
	transferAll(t, r, SendOptions{Auth: tokenAuth(goodToken), Streams: 2, AutoCommit: true})
}

func TestTCPWrongToken(t *testing.T) {
	r := startReceiver(t, tokenAuth(goodToken))
	_, err := Dial(testCtx(t), r.addr(), SendOptions{Auth: tokenAuth(otherToken), Streams: 2})
	if err == nil || !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "token does not match") {
		t.Fatalf("sender with the wrong token: %v", err)
	}
	r.log.waitLog(t, "authentication failed")
	// The receiver goes on and takes the real sender.
	transferAll(t, r, SendOptions{Auth: tokenAuth(goodToken), AutoCommit: true})
}

func TestTCPNoSecretRefused(t *testing.T) {
	if _, err := Listen(testCtx(t), "127.0.0.1:0", ListenOptions{}); err == nil {
		t.Fatal("a receiver without token or certificates was allowed")
	}
	if _, err := Dial(testCtx(t), "127.0.0.1:1", SendOptions{}); err == nil {
		t.Fatal("a sender without token or certificates was allowed")
	}
}

// An impostor receiver accepts the TLS connection but cannot prove the
// token: the sender must refuse it and send nothing.
func TestTCPImpostorReceiver(t *testing.T) {
	cert, err := ephemeralCert()
	if err != nil {
		t.Fatal(err)
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	got := make(chan int, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		hb := make([]byte, wire.HelloSize)
		if _, err := io.ReadFull(c, hb); err != nil {
			return
		}
		var fake wire.Reply
		rand.Read(fake.Proof[:])
		c.Write(fake.Marshal())
		n, _ := io.Copy(io.Discard, c)
		got <- int(n)
	}()
	_, err = Dial(testCtx(t), ln.Addr().String(), SendOptions{Auth: tokenAuth(goodToken)})
	if err == nil || !strings.Contains(err.Error(), "did not prove") {
		t.Fatalf("impostor receiver: %v", err)
	}
	if n := <-got; n != 0 {
		t.Fatalf("the sender sent %d bytes to an impostor after its hello", n)
	}
}

// rawClient does the TLS handshake and returns the connection and its
// exporter, for hand-made hellos.
func rawClient(t *testing.T, addr string) (*tls.Conn, []byte) {
	t.Helper()
	cfg, _ := tokenAuth(goodToken).clientConfig("127.0.0.1")
	c, err := tls.Dial("tcp", addr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	exp, err := exporterOf(c)
	if err != nil {
		t.Fatal(err)
	}
	return c, exp
}

// A hello captured on one connection is refused on another: the proof is
// bound to the channel.
func TestTCPReplayRefused(t *testing.T) {
	r := startReceiver(t, tokenAuth(goodToken))
	c1, exp1 := rawClient(t, r.addr())
	defer c1.Close()
	h := wire.Hello{Shard: 0, Count: 2, Session: [16]byte{1, 2, 3}}
	hb := h.Marshal()
	h.Proof = proof([]byte(goodToken), "client", exp1, hb[:32])
	hb = h.Marshal()
	if _, err := c1.Write(hb); err != nil {
		t.Fatal(err)
	}
	rep, _, err := wire.ReadReply(c1)
	if err != nil || rep.Refused {
		t.Fatalf("genuine hello: %+v %v", rep, err)
	}
	// The same bytes on a new connection, as shard 0 and as shard 1.
	for _, shard := range []uint16{0, 1} {
		c2, _ := rawClient(t, r.addr())
		replay := append([]byte(nil), hb...)
		replay[12] = byte(shard)
		if _, err := c2.Write(replay); err != nil {
			t.Fatal(err)
		}
		rep, _, err := wire.ReadReply(c2)
		c2.Close()
		if err != nil || !rep.Refused || !strings.Contains(rep.Message, "authentication failed") {
			t.Fatalf("replayed hello (shard %d): %+v %v", shard, rep, err)
		}
	}
	// A second genuine connection for shard 0 of that session is refused too.
	c3, exp3 := rawClient(t, r.addr())
	defer c3.Close()
	h3 := wire.Hello{Shard: 0, Count: 2, Session: [16]byte{1, 2, 3}}
	hb3 := h3.Marshal()
	h3.Proof = proof([]byte(goodToken), "client", exp3, hb3[:32])
	c3.Write(h3.Marshal())
	rep, _, err = wire.ReadReply(c3)
	if err != nil || !rep.Refused || !strings.Contains(rep.Message, "already connected") {
		t.Fatalf("duplicate stream: %+v %v", rep, err)
	}
	// The log line follows the reply the client read.
	deadline := time.Now().Add(testwait.Scale(10 * time.Second))
	for strings.Count(r.log.String(), "authentication failed") != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("want two authentication failures in the log:\n%s", r.log.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Garbage of several kinds is refused, and the receiver then takes the
// next real sender.
func TestTCPGarbageThenRealSender(t *testing.T) {
	r := startReceiver(t, tokenAuth(goodToken))
	junk := make([]byte, 4096)
	rand.Read(junk)
	for _, b := range [][]byte{junk, []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), {0x16, 0x03, 0x01, 0xff, 0xff}, nil} {
		c, err := net.Dial("tcp", r.addr())
		if err != nil {
			t.Fatal(err)
		}
		c.Write(b)
		if b == nil {
			c.Close() // connect and hang up
			continue
		}
		c.SetReadDeadline(time.Now().Add(testwait.Scale(5 * time.Second)))
		io.Copy(io.Discard, c) // the receiver hangs up
		c.Close()
	}
	// TLS done right, then garbage instead of a hello.
	c, _ := rawClient(t, r.addr())
	c.Write(bytes.Repeat([]byte{'x'}, wire.HelloSize))
	rep, _, err := wire.ReadReply(c)
	c.Close()
	if err != nil || !rep.Refused || !strings.Contains(rep.Message, "not a gpucr-stream sender") {
		t.Fatalf("garbage hello: %+v %v", rep, err)
	}
	r.log.waitLog(t, "TLS handshake failed")
	transferAll(t, r, SendOptions{Auth: tokenAuth(goodToken), Streams: 2, AutoCommit: true})
	if n := strings.Count(r.log.String(), "refused"); n < 4 {
		t.Errorf("want the garbage peers refused in the log:\n%s", r.log.String())
	}
}

// A transfer that breaks leaves nothing to serve, and the receiver says why.
func TestTCPBrokenTransfer(t *testing.T) {
	r := startReceiver(t, tokenAuth(goodToken))
	out, err := Dial(testCtx(t), r.addr(), SendOptions{Auth: tokenAuth(goodToken), Streams: 2})
	if err != nil {
		t.Fatal(err)
	}
	c, err := streamer.NewCapture(testCtx(t), out, pipeline.Options{ChunkSize: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	big := make([]byte, 8<<20)
	rand.Read(big)
	if _, err := c.WriteFile("pages-1.img", bytes.NewReader(big), false); err != nil {
		t.Fatal(err)
	}
	// Wait until some of it arrived, then cut every connection.
	for r.src.Session() == nil || r.src.Session().StreamBytes() < 1<<20 {
		time.Sleep(5 * time.Millisecond)
	}
	out.Close()
	_, err = r.src.WaitCommitted(testCtx(t))
	if err == nil || !strings.Contains(err.Error(), "broke") {
		t.Fatalf("receiver after a cut: %v", err)
	}
	if _, err := r.src.Stat(testCtx(t), "pages-1.img"); err == nil {
		t.Fatal("a file of a broken transfer was served")
	}
	c.Abort(errors.New("test"))
	c.Close(testCtx(t), manifest.Manifest{})
}

// The sender aborts after the receiver acknowledged (criu dump failed
// late): nothing is restored.
func TestTCPAbortAfterAck(t *testing.T) {
	r := startReceiver(t, tokenAuth(goodToken))
	out, err := Dial(testCtx(t), r.addr(), SendOptions{Auth: tokenAuth(goodToken)})
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if err := send(t, out, testFiles()); err != nil {
		t.Fatal(err)
	}
	out.Cancel("criu dump failed after the acknowledgement")
	_, err = r.src.WaitCommitted(testCtx(t))
	if err == nil || !strings.Contains(err.Error(), "criu dump failed after") {
		t.Fatalf("receiver after abort: %v", err)
	}
}

// A sender that hangs up after the acknowledgement without committing:
// nothing is restored.
func TestTCPNoCommit(t *testing.T) {
	r := startReceiver(t, tokenAuth(goodToken))
	out, err := Dial(testCtx(t), r.addr(), SendOptions{Auth: tokenAuth(goodToken)})
	if err != nil {
		t.Fatal(err)
	}
	if err := send(t, out, testFiles()); err != nil {
		t.Fatal(err)
	}
	out.Close()
	_, err = r.src.WaitCommitted(testCtx(t))
	if err == nil || !strings.Contains(err.Error(), "did not commit") {
		t.Fatalf("receiver without commit: %v", err)
	}
}

// The receiver dies during the transfer: the sender's capture fails (so
// CRIU would resume the process), promptly, through OnFailure.
func TestTCPReceiverDies(t *testing.T) {
	r := startReceiver(t, tokenAuth(goodToken))
	out, err := Dial(testCtx(t), r.addr(), SendOptions{Auth: tokenAuth(goodToken), Streams: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	failed := make(chan error, 1)
	out.OnFailure(func(err error) { failed <- err })
	for r.src.Session() == nil {
		time.Sleep(5 * time.Millisecond)
	}
	r.src.Close()
	// A stream of data that never ends: the capture must fail.
	c, err := streamer.NewCapture(testCtx(t), out, pipeline.Options{ChunkSize: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	out.OnFailure(func(err error) { c.Abort(err); failed <- err })
	_, err = c.WriteFile("pages-1.img", io.LimitReader(rand.Reader, 1<<30), false)
	if err == nil {
		t.Fatal("capture went on after the receiver died")
	}
	select {
	case <-failed:
	case <-time.After(testwait.Scale(10 * time.Second)):
		t.Fatal("OnFailure not called")
	}
	_, err = c.Close(testCtx(t), manifest.Manifest{})
	if err == nil {
		t.Fatal("commit succeeded after the receiver died")
	}
}

// A stream that fails its checks is rejected (NAK) and the sender's commit
// fails with the receiver's reason.
func TestTCPCorruptStreamNak(t *testing.T) {
	r := startReceiver(t, tokenAuth(goodToken))
	c, exp := rawClient(t, r.addr())
	defer c.Close()
	h := wire.Hello{Shard: 0, Count: 1, Session: [16]byte{9}}
	hb := h.Marshal()
	h.Proof = proof([]byte(goodToken), "client", exp, hb[:32])
	c.Write(h.Marshal())
	br := bufio.NewReader(c)
	if rep, _, err := wire.ReadReply(br); err != nil || rep.Refused {
		t.Fatalf("%+v %v", rep, err)
	}
	wire.WriteRecord(c, wire.RecData, bytes.Repeat([]byte("not a stream "), 10))
	wire.WriteRecord(c, wire.RecEOS, nil)
	rh, p, err := wire.ReadRecord(br, false)
	if err != nil || rh.Type != wire.RecNak {
		t.Fatalf("want NAK, got %+v %q %v", rh, p, err)
	}
	if _, err := r.src.WaitCommitted(testCtx(t)); err == nil || !errors.Is(err, errdefs.ErrCorrupt) {
		t.Fatalf("receiver: %v", err)
	}
}

// makeCA returns a CA and a certificate signed by it for 127.0.0.1.
func makeCA(t *testing.T, name string) (*x509.CertPool, tls.Certificate) {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name + " CA"}, IsCA: true,
		BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: name}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}, KeyUsage: x509.KeyUsageDigitalSignature,
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	return pool, tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

func TestTCPCertificates(t *testing.T) {
	pool, cert := makeCA(t, "site")
	otherPool, otherCert := makeCA(t, "elsewhere")
	auth := Auth{Cert: &cert, CAs: pool}
	r := startReceiver(t, auth)
	// A client whose certificate another CA signed is refused by TLS.
	_, err := Dial(testCtx(t), r.addr(), SendOptions{Auth: Auth{Cert: &otherCert, CAs: pool}})
	if err == nil {
		t.Fatal("certificate from a foreign CA accepted")
	}
	// A client that does not trust the receiver's CA refuses it.
	_, err = Dial(testCtx(t), r.addr(), SendOptions{Auth: Auth{Cert: &cert, CAs: otherPool}})
	if err == nil {
		t.Fatal("receiver with an untrusted certificate accepted")
	}
	r.log.waitLog(t, "TLS handshake failed")
	transferAll(t, r, SendOptions{Auth: auth, Streams: 2, AutoCommit: true})
}

func TestTokenFile(t *testing.T) {
	dir := t.TempDir()
	tok := NewToken()
	if len(tok) != 64 || tok == NewToken() {
		t.Fatalf("token %q", tok)
	}
	p := dir + "/tok"
	writeFile(t, p, tok+"\n")
	got, err := ReadTokenFile(p)
	if err != nil || string(got) != tok {
		t.Fatalf("read token: %q %v", got, err)
	}
	writeFile(t, p, "short\n")
	if _, err := ReadTokenFile(p); err == nil {
		t.Fatal("short token accepted")
	}
	if _, err := LoadAuth("", "cert.pem", "", ""); err == nil {
		t.Fatal("incomplete certificate flags accepted")
	}
}

func writeFile(t *testing.T, p, s string) {
	t.Helper()
	if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
}
