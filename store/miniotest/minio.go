// Package miniotest starts a real MinIO server for tests: on loopback, on a
// free port, with random credentials and a temporary data directory, and
// kills it when the test ends. Stop and Restart (same port, same data)
// inject the fault of a server that goes away in the middle of a transfer.
//
// The server binary is the pinned build that scripts/install-minio.sh
// installs. Without it tests are skipped, except under CI=true, where a
// missing MinIO fails the run.
package miniotest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// Version is the MinIO server build the tests expect (go install
// github.com/minio/minio@Version); scripts/install-minio.sh pins the same.
const Version = "v0.0.0-20260212201848-7aac2a2c5b7c"

// Server is a running (or stopped) MinIO server.
type Server struct {
	bin     string
	dataDir string
	addr    string // 127.0.0.1:port of the S3 API
	console string
	user    string
	pass    string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited
	log  *lockedBuffer

	opts     Options
	certsDir string // TLS: public.crt and private.key
	kmsKey   string // KMS: MINIO_KMS_SECRET_KEY
}

// Find returns the path of the minio binary: $MINIO_BINARY, then PATH,
// /usr/local/bin/minio, and $(go env GOPATH)/bin/minio.
func Find() (string, error) {
	if p := os.Getenv("MINIO_BINARY"); p != "" {
		return exec.LookPath(p)
	}
	if p, err := exec.LookPath("minio"); err == nil {
		return p, nil
	}
	cands := []string{"/usr/local/bin/minio"}
	gopath := os.Getenv("GOPATH")
	if gopath == "" {
		if out, err := exec.Command("go", "env", "GOPATH").Output(); err == nil {
			gopath = strings.TrimSpace(string(out))
		}
	}
	for _, dir := range filepath.SplitList(gopath) {
		cands = append(cands, filepath.Join(dir, "bin", "minio"))
	}
	for _, p := range cands {
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("no minio binary in $MINIO_BINARY, PATH, /usr/local/bin or $(go env GOPATH)/bin; run scripts/install-minio.sh (installs github.com/minio/minio@%s)", Version)
}

// Start starts a MinIO server for t, or skips t when there is no minio
// binary (fails it under CI=true). The server is killed when t ends.
func Start(t testing.TB) *Server {
	t.Helper()
	return StartWith(t, Options{})
}

// Options add features to a test server.
type Options struct {
	// KMS gives the server a built-in KMS key (MINIO_KMS_SECRET_KEY), so
	// that it accepts SSE-S3 and SSE-KMS (key id: KMSKeyID).
	KMS bool
	// TLS serves https with a new self-signed certificate (CAFile): MinIO
	// accepts SSE-C only over TLS.
	TLS bool
}

// KMSKeyID is the name of the KMS key of a server started with KMS.
const KMSKeyID = "gpucr-test-key"

// StartWith is Start with features.
func StartWith(t testing.TB, o Options) *Server {
	t.Helper()
	bin, err := Find()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true and %v", err)
		}
		t.Skipf("skipping: %v", err)
	}
	s := &Server{
		bin:     bin,
		dataDir: t.TempDir(),
		user:    "test-" + randomHex(8),
		pass:    randomHex(20),
		log:     &lockedBuffer{},
		opts:    o,
	}
	if o.TLS {
		s.certsDir = t.TempDir()
		if err := writeCert(s.certsDir); err != nil {
			t.Fatalf("minio certificate: %v", err)
		}
	}
	if o.KMS {
		s.kmsKey = KMSKeyID + ":" + base64.StdEncoding.EncodeToString([]byte(randomHex(16)))
	}
	t.Cleanup(func() {
		s.Stop()
		if t.Failed() {
			t.Logf("minio log (tail):\n%s", s.log.tail(4000))
		}
	})
	// A port found free can be taken before minio binds it; try again.
	for attempt := 0; ; attempt++ {
		s.addr, s.console = freeAddr(t), freeAddr(t)
		err := s.start()
		if err == nil {
			return s
		}
		if attempt == 2 {
			t.Fatalf("start minio: %v\n%s", err, s.log.tail(4000))
		}
	}
}

func (s *Server) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		return fmt.Errorf("minio already running")
	}
	args := []string{"server", s.dataDir, "--address", s.addr, "--console-address", s.console, "--quiet"}
	if s.certsDir != "" {
		args = append(args, "--certs-dir", s.certsDir)
	}
	cmd := exec.Command(s.bin, args...)
	env := []string{}
	for _, kv := range os.Environ() {
		// The caller's MinIO settings must not leak into the test server.
		if !strings.HasPrefix(kv, "MINIO_") {
			env = append(env, kv)
		}
	}
	cmd.Env = append(env,
		"MINIO_ROOT_USER="+s.user,
		"MINIO_ROOT_PASSWORD="+s.pass,
		"MINIO_BROWSER=off",
		"MINIO_UPDATE=off",
	)
	if s.kmsKey != "" {
		cmd.Env = append(cmd.Env, "MINIO_KMS_SECRET_KEY="+s.kmsKey)
	}
	cmd.Stdout, cmd.Stderr = s.log, s.log
	// Die with the test binary even if it is killed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", s.bin, err)
	}
	done := make(chan struct{})
	go func() { // owned by Stop, which waits for done
		_ = cmd.Wait()
		close(done)
	}()
	s.cmd, s.done = cmd, done
	if err := s.waitLive(done); err != nil {
		s.stopLocked()
		return err
	}
	return nil
}

// waitLive polls the liveness endpoint until it answers 200.
func (s *Server) waitLive(exited <-chan struct{}) error {
	client := &http.Client{Timeout: time.Second, Transport: s.transport()}
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := client.Get(s.Endpoint() + "/minio/health/live")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-exited:
			return fmt.Errorf("minio exited during start")
		case <-time.After(50 * time.Millisecond):
		}
	}
	return fmt.Errorf("minio at %s not live after 60s", s.addr)
}

// Stop kills the server (SIGKILL: a crash, not a clean shutdown) and waits
// for it to exit. Stopping a stopped server does nothing.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stopLocked()
}

func (s *Server) stopLocked() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	<-s.done
	s.cmd, s.done = nil, nil
}

// Restart starts the server again on the same port and data directory,
// stopping it first if it runs.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.Stop()
	var err error
	// The port was ours a moment ago; give the kernel a moment if needed.
	for range 20 {
		if err = s.start(); err == nil {
			return
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Fatalf("restart minio: %v\n%s", err, s.log.tail(4000))
}

// Endpoint is the server's URL, http://127.0.0.1:PORT (https with TLS).
func (s *Server) Endpoint() string {
	if s.certsDir != "" {
		return "https://" + s.addr
	}
	return "http://" + s.addr
}

// CAFile is the certificate to trust (AWS_CA_BUNDLE) of a TLS server.
func (s *Server) CAFile() string { return filepath.Join(s.certsDir, "public.crt") }

// Addr is the server's host:port.
func (s *Server) Addr() string { return s.addr }

// AccessKey is the root user.
func (s *Server) AccessKey() string { return s.user }

// SecretKey is the root password.
func (s *Server) SecretKey() string { return s.pass }

// Client returns a minio-go client with the root credentials, for test
// set-up and inspection.
func (s *Server) Client(t testing.TB) *minio.Client {
	t.Helper()
	c, err := minio.New(s.addr, &minio.Options{Creds: credentials.NewStaticV4(s.user, s.pass, ""), Secure: s.certsDir != "", Transport: s.transport()})
	if err != nil {
		t.Fatalf("minio client: %v", err)
	}
	return c
}

// MakeBucket creates a bucket.
func (s *Server) MakeBucket(t testing.TB, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Client(t).MakeBucket(ctx, name, minio.MakeBucketOptions{}); err != nil {
		t.Fatalf("make bucket %s: %v", name, err)
	}
}

func freeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("find a free port: %v", err)
	}
	defer l.Close()
	return l.Addr().String()
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// lockedBuffer collects the server's output.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.buf.Len() > 1<<20 {
		b.buf.Reset()
	}
	return b.buf.Write(p)
}

func (b *lockedBuffer) tail(n int) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.buf.String()
	if len(s) > n {
		s = s[len(s)-n:]
	}
	return s
}
