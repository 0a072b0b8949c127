package s3

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/miniotest"
	"github.com/gpucr/gpucr-stream/store/storetest"
	"github.com/gpucr/gpucr-stream/testwait"
)

// clearAWSEnv keeps the developer's own AWS settings out of a test.
func clearAWSEnv(t *testing.T) {
	t.Helper()
	for _, k := range []string{"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY", "AWS_SECRET_KEY",
		"AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION"} {
		t.Setenv(k, "")
	}
	dir := t.TempDir()
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", filepath.Join(dir, "no-credentials"))
	t.Setenv("AWS_CONFIG_FILE", filepath.Join(dir, "no-config"))
	t.Setenv("HOME", dir)
}

func testConfig(srv *miniotest.Server, bucket, prefix string) Config {
	return Config{
		Endpoint:   srv.Endpoint(),
		Bucket:     bucket,
		Prefix:     prefix,
		AccessKey:  srv.AccessKey(),
		SecretKey:  srv.SecretKey(),
		PartSize:   minS3PartSize,
		Parallel:   3,
		MaxRetries: 3,
	}
}

func newTestS3(t *testing.T, cfg Config) *Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	s, err := New(ctx, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func TestS3Conformance(t *testing.T) {
	srv := miniotest.Start(t)
	srv.MakeBucket(t, "suite")
	var n atomic.Int64
	storetest.Run(t, func(t *testing.T) store.Store {
		// A fresh prefix per subtest: that the store stays inside its
		// prefix is part of what is tested.
		return newTestS3(t, testConfig(srv, "suite", fmt.Sprintf("run/%d/", n.Add(1))))
	})
}

// TestS3NoPrefix runs the suite on a bucket root, reached through the
// environment rather than the config.
func TestS3NoPrefix(t *testing.T) {
	srv := miniotest.Start(t)
	clearAWSEnv(t)
	t.Setenv("AWS_ENDPOINT_URL", srv.Endpoint())
	t.Setenv("AWS_ACCESS_KEY_ID", srv.AccessKey())
	t.Setenv("AWS_SECRET_ACCESS_KEY", srv.SecretKey())
	var n atomic.Int64
	storetest.Run(t, func(t *testing.T) store.Store {
		bucket := fmt.Sprintf("root-%d", n.Add(1))
		srv.MakeBucket(t, bucket)
		return newTestS3(t, Config{Bucket: bucket, PartSize: minS3PartSize, PathStyle: PathStyleOn})
	})
}

func TestS3CredentialsFile(t *testing.T) {
	srv := miniotest.Start(t)
	srv.MakeBucket(t, "bkt")
	clearAWSEnv(t)
	file := filepath.Join(t.TempDir(), "credentials")
	body := fmt.Sprintf("[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n[ckpt]\naws_access_key_id = %s\naws_secret_access_key = %s\n",
		srv.AccessKey(), srv.SecretKey())
	if err := os.WriteFile(file, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", file)
	t.Setenv("AWS_PROFILE", "ckpt")
	s := newTestS3(t, Config{Endpoint: srv.Endpoint(), Bucket: "bkt", Prefix: "p"})
	if got := s.String(); got != "s3://bkt/p" {
		t.Errorf("String() = %q", got)
	}
	// The default profile holds wrong keys: a clear refusal naming them.
	t.Setenv("AWS_PROFILE", "")
	_, err := New(context.Background(), Config{Endpoint: srv.Endpoint(), Bucket: "bkt", MaxRetries: -1})
	if !errors.Is(err, ErrBadCredentials) || !strings.Contains(err.Error(), "wrong") {
		t.Errorf("default profile with wrong keys: %v", err)
	}
	// A profile that is not there.
	t.Setenv("AWS_PROFILE", "absent")
	_, err = New(context.Background(), Config{Endpoint: srv.Endpoint(), Bucket: "bkt"})
	if !errors.Is(err, ErrNoCredentials) || !strings.Contains(err.Error(), `"absent"`) {
		t.Errorf("missing profile: %v", err)
	}
}

func TestS3NoCredentials(t *testing.T) {
	clearAWSEnv(t)
	// No server is needed: the error comes before any request.
	_, err := New(context.Background(), Config{Endpoint: "http://127.0.0.1:1", Bucket: "bkt"})
	if !errors.Is(err, ErrNoCredentials) {
		t.Fatalf("New without credentials = %v; want ErrNoCredentials", err)
	}
	for _, want := range []string{"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "anonymous"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %s", err, want)
		}
	}
	t.Setenv("AWS_ACCESS_KEY_ID", "AKIAHALF")
	_, err = New(context.Background(), Config{Endpoint: "http://127.0.0.1:1", Bucket: "bkt"})
	if !errors.Is(err, ErrNoCredentials) || !strings.Contains(err.Error(), "AWS_SECRET_ACCESS_KEY") {
		t.Errorf("half the credentials: %v", err)
	}
}

func TestS3WrongCredentials(t *testing.T) {
	srv := miniotest.Start(t)
	srv.MakeBucket(t, "bkt")
	clearAWSEnv(t)
	for _, c := range []struct {
		name, key, secret string
	}{
		{"unknown key", "AKIANOSUCHKEY", "some-secret-value-1234"},
		{"wrong secret", srv.AccessKey(), "not-the-secret-5678"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := Config{Endpoint: srv.Endpoint(), Bucket: "bkt", AccessKey: c.key, SecretKey: c.secret}
			_, err := New(context.Background(), cfg)
			if !errors.Is(err, ErrBadCredentials) {
				t.Fatalf("New = %v; want ErrBadCredentials", err)
			}
			if !strings.Contains(err.Error(), c.key) {
				t.Errorf("error %q does not name the access key id", err)
			}
			if strings.Contains(err.Error(), c.secret) {
				t.Errorf("error %q shows the secret", err)
			}
			t.Log(err)
		})
	}
}

func TestS3MissingBucket(t *testing.T) {
	srv := miniotest.Start(t)
	_, err := New(context.Background(), testConfig(srv, "no-such-bucket", "x"))
	if !errors.Is(err, ErrNoSuchBucket) {
		t.Fatalf("New = %v; want ErrNoSuchBucket", err)
	}
	want := "s3://no-such-bucket: no such bucket at " + srv.Endpoint()
	if !strings.Contains(err.Error(), want) {
		t.Errorf("error %q does not say %q", err, want)
	}
}

// TestS3CreateBucket: CreateBucket makes a missing bucket, which then
// holds objects; a second New finds it.
func TestS3CreateBucket(t *testing.T) {
	srv := miniotest.Start(t)
	ctx := context.Background()
	cfg := testConfig(srv, "made-by-gpucr", "x")
	cfg.CreateBucket = true
	for range 2 {
		st, err := New(ctx, cfg)
		if err != nil {
			t.Fatalf("New with CreateBucket: %v", err)
		}
		w, err := st.Create(ctx, "obj")
		if err != nil {
			t.Fatal(err)
		}
		w.Write([]byte("hello"))
		if err := w.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		st.Close()
	}
}

func TestS3Unreachable(t *testing.T) {
	cfg := Config{Endpoint: "http://127.0.0.1:1", Bucket: "bkt", AccessKey: "k", SecretKey: "s3cr3t-value", MaxRetries: 1}
	_, err := New(context.Background(), cfg)
	if err == nil || !strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Fatalf("New of an unreachable endpoint = %v", err)
	}
	t.Log(err)
	if strings.Contains(err.Error(), "s3cr3t-value") {
		t.Errorf("error shows the secret: %v", err)
	}
}

func TestS3SecretsNotShown(t *testing.T) {
	srv := miniotest.Start(t)
	srv.MakeBucket(t, "bkt")
	s := newTestS3(t, testConfig(srv, "bkt", "/ckpt/one/"))
	ctx := context.Background()
	if got := s.String(); got != "s3://bkt/ckpt/one" {
		t.Errorf("String() = %q", got)
	}
	var msgs []string
	if _, err := s.Open(ctx, "missing", 0, -1); err != nil {
		msgs = append(msgs, err.Error())
	}
	if _, err := s.Stat(ctx, "missing"); err != nil {
		msgs = append(msgs, err.Error())
	}
	if _, err := s.Create(ctx, "../x"); err != nil {
		msgs = append(msgs, err.Error())
	}
	msgs = append(msgs, s.String(), fmt.Sprintf("%v %+v", s, s))
	for _, m := range msgs {
		if strings.Contains(m, srv.SecretKey()) {
			t.Errorf("secret shown in %q", m)
		}
	}
	if !strings.Contains(msgs[0], "s3://bkt/ckpt/one/missing") {
		t.Errorf("error %q does not name the object", msgs[0])
	}
}

func TestParsePathStyle(t *testing.T) {
	for in, want := range map[string]PathStyle{"": PathStyleAuto, "auto": PathStyleAuto, "true": PathStyleOn, "path": PathStyleOn, "false": PathStyleOff, "virtual": PathStyleOff} {
		if got, err := ParsePathStyle(in); err != nil || got != want {
			t.Errorf("ParsePathStyle(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	if _, err := ParsePathStyle("sideways"); err == nil {
		t.Error("ParsePathStyle accepted nonsense")
	}
}

func TestS3Endpoint(t *testing.T) {
	clearAWSEnv(t)
	for _, c := range []struct {
		cfg     Config
		env     string
		host    string
		secure  bool
		wantErr bool
	}{
		{cfg: Config{Endpoint: "http://127.0.0.1:9000"}, host: "127.0.0.1:9000"},
		{cfg: Config{Endpoint: "https://s3.example.test"}, host: "s3.example.test", secure: true},
		{cfg: Config{Endpoint: "minio.local:9000"}, host: "minio.local:9000", secure: true},
		{cfg: Config{Endpoint: "minio.local:9000", Insecure: true}, host: "minio.local:9000"},
		{env: "http://10.0.0.1:9000", host: "10.0.0.1:9000"},
		{cfg: Config{Endpoint: "ftp://x"}, wantErr: true},
		{cfg: Config{Endpoint: "http://user:pw@x"}, wantErr: true},
		{cfg: Config{Endpoint: "http://x/path"}, wantErr: true},
	} {
		t.Setenv("AWS_ENDPOINT_URL", c.env)
		host, secure, _, err := s3Endpoint(c.cfg)
		if (err != nil) != c.wantErr || (err == nil && (host != c.host || secure != c.secure)) {
			t.Errorf("s3Endpoint(%+v, env %q) = %q, %v, %v", c.cfg.Endpoint, c.env, host, secure, err)
		}
		if err != nil && strings.Contains(err.Error(), "pw") {
			t.Errorf("error shows the password: %v", err)
		}
	}
}

// TestS3UploadShape checks what goes over the wire: a small object in one
// PUT, a larger one as a multipart upload of PartSize parts.
func TestS3UploadShape(t *testing.T) {
	srv := miniotest.Start(t)
	srv.MakeBucket(t, "bkt")
	cfg := testConfig(srv, "bkt", "shape")
	cfg.ContentMD5 = true // the MD5 path too
	s := newTestS3(t, cfg)
	ctx := context.Background()
	put := func(name string, n int) {
		w, err := s.Create(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.CopyN(w, rand.Reader, int64(n)); err != nil {
			t.Fatal(err)
		}
		if err := w.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	put("small", 1000)
	put("exact", minS3PartSize)
	put("multi", 2*minS3PartSize+1)
	for name, parts := range map[string]string{"small": "", "exact": "", "multi": "-3"} {
		info, err := s.core.StatObject(ctx, "bkt", "shape/"+name, minio.StatObjectOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if i := strings.LastIndexByte(info.ETag, '-'); (parts == "" && i >= 0) || (parts != "" && (i < 0 || info.ETag[i:] != parts)) {
			t.Errorf("%s: ETag %q; want a %q multipart suffix", name, info.ETag, parts)
		}
	}
}

// TestS3ServerStoppedMidUpload: the server dies while parts are going
// out. Commit must fail, and once the server is back nothing is visible;
// the leftover upload is found and removed by RemoveIncomplete.
func TestS3ServerStoppedMidUpload(t *testing.T) {
	srv := miniotest.Start(t)
	srv.MakeBucket(t, "bkt")
	cfg := testConfig(srv, "bkt", "ckpt")
	cfg.MaxRetries = 2
	s := newTestS3(t, cfg)
	ctx := context.Background()
	w, err := s.Create(ctx, "seg/00000.seg")
	if err != nil {
		t.Fatal(err)
	}
	data := make([]byte, 12<<20)
	if _, err := w.Write(data); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	start := time.Now()
	var werr error
	for i := 0; i < 20 && werr == nil; i++ { // 100 MiB more: parts start failing
		_, werr = w.Write(data[:5<<20])
	}
	if werr == nil {
		t.Error("Write kept succeeding with the server down")
	} else {
		t.Logf("Write failed after %v: %v", time.Since(start).Round(time.Millisecond), werr)
	}
	err = w.Commit(ctx)
	if err == nil {
		t.Fatal("Commit succeeded with the server down")
	}
	t.Logf("Commit: %v", err)
	if d := time.Since(start); d > 30*time.Second {
		t.Errorf("failing took %v", d)
	}
	srv.Restart(t)
	if _, err := s.Stat(ctx, "seg/00000.seg"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Stat after restart = %v; want errdefs.ErrNotFound", err)
	}
	if list, err := s.List(ctx, ""); err != nil || len(list) != 0 {
		t.Errorf("List after restart = %v, %v; want nothing", list, err)
	}
	// The abort could not reach the server; Abort again now it is back.
	if err := w.Abort(ctx); err != nil {
		t.Errorf("Abort after restart: %v", err)
	}
	n, err := s.RemoveIncomplete(ctx, "", time.Now(), all)
	if err != nil || n != 0 {
		t.Errorf("RemoveIncomplete after Abort = %d, %v; want 0", n, err)
	}

	// An upload abandoned without Abort (a killed process) is found by
	// RemoveIncomplete.
	if _, err := s.core.NewMultipartUpload(ctx, "bkt", "ckpt/seg/00001.seg", minio.PutObjectOptions{}); err != nil {
		t.Fatal(err)
	}
	if n, err := s.RemoveIncomplete(ctx, "", time.Now().Add(-time.Hour), all); err != nil || n != 0 {
		t.Errorf("RemoveIncomplete(older than an hour) = %d, %v; want 0", n, err)
	}
	// Another program's upload beside it is left alone: only what ours
	// recognises is aborted.
	if _, err := s.core.NewMultipartUpload(ctx, "bkt", "ckpt/notes.txt", minio.PutObjectOptions{}); err != nil {
		t.Fatal(err)
	}
	ours := func(name string) bool { return strings.HasPrefix(name, "seg/") }
	if n, err := s.RemoveIncomplete(ctx, "", time.Now(), ours); err != nil || n != 1 {
		t.Errorf("RemoveIncomplete = %d, %v; want 1", n, err)
	}
	if n, err := s.RemoveIncomplete(ctx, "", time.Now(), all); err != nil || n != 1 {
		t.Errorf("RemoveIncomplete of the other upload = %d, %v; want 1", n, err)
	}
}

// all recognises every object name.
func all(string) bool { return true }

// TestS3ServerRestartMidRead: a reader whose connection dies resumes from
// where it stopped once the server is back, and returns the right bytes.
func TestS3ServerRestartMidRead(t *testing.T) {
	srv := miniotest.Start(t)
	srv.MakeBucket(t, "bkt")
	s := newTestS3(t, testConfig(srv, "bkt", ""))
	ctx := context.Background()
	data := make([]byte, 24<<20)
	_, _ = rand.Read(data)
	w, err := s.Create(ctx, "pages")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := w.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r, err := s.Open(ctx, "pages", 1000, int64(len(data))-2000)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	got := make([]byte, len(data)-2000)
	if _, err := io.ReadFull(r, got[:1<<20]); err != nil {
		t.Fatal(err)
	}
	srv.Restart(t)
	if _, err := io.ReadFull(r, got[1<<20:]); err != nil {
		t.Fatalf("read across a restart: %v", err)
	}
	if !bytes.Equal(got, data[1000:len(data)-1000]) {
		t.Error("bytes read across a restart differ")
	}
	if n := r.(*s3Reader).resumes; n == 0 {
		t.Error("the reader never had to resume: the test did not cut its connection")
	}
}

// TestS3ChecksumsChecked makes sure the server checks the CRC32C the store
// sends (a wrong header name would be ignored silently).
func TestS3ChecksumsChecked(t *testing.T) {
	srv := miniotest.Start(t)
	srv.MakeBucket(t, "bkt")
	s := newTestS3(t, testConfig(srv, "bkt", ""))
	ctx := context.Background()
	data := []byte("the bytes that were sent")
	wrong, _ := checksums([][]byte{[]byte("other bytes")}, false)
	_, err := s.core.PutObject(ctx, "bkt", "small", bytes.NewReader(data), int64(len(data)), "", "",
		minio.PutObjectOptions{UserMetadata: map[string]string{hdrChecksumCRC32C: wrong}, DisableContentSha256: true})
	if err == nil {
		t.Error("PUT with a wrong CRC32C succeeded")
	}
	id, err := s.core.NewMultipartUpload(ctx, "bkt", "multi", minio.PutObjectOptions{UserMetadata: map[string]string{hdrChecksumAlgo: "CRC32C"}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.core.AbortMultipartUpload(ctx, "bkt", "multi", id)
	hdr := map[string][]string{hdrChecksumCRC32C: {wrong}}
	_, err = s.core.PutObjectPart(ctx, "bkt", "multi", id, 1, bytes.NewReader(data), int64(len(data)),
		minio.PutObjectPartOptions{CustomHeader: hdr, DisableContentSha256: true})
	if err == nil {
		t.Error("part with a wrong CRC32C accepted")
	}
	t.Log(err)
}

// TestS3PartPieces writes objects in writes of odd sizes, with a part size
// that is no multiple of a piece: small objects in one small buffer grown
// as needed, larger ones in parts of pooled pieces that the next object
// reuses.
func TestS3PartPieces(t *testing.T) {
	srv := miniotest.Start(t)
	srv.MakeBucket(t, "bkt")
	cfg := testConfig(srv, "bkt", "pieces")
	cfg.PartSize = minS3PartSize + 12345
	cfg.ContentMD5 = true
	s := newTestS3(t, cfg)
	ctx := context.Background()
	put := func(name string, size, write int) {
		t.Helper()
		data := make([]byte, size)
		rand.Read(data)
		w, err := s.Create(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		for b := data; len(b) > 0; {
			n, err := w.Write(b[:min(write, len(b))])
			if err != nil {
				t.Fatal(err)
			}
			b = b[n:]
		}
		if err := w.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		r, err := s.Open(ctx, name, 0, -1)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		got, err := io.ReadAll(r)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("%s: read back %d bytes (%v), want the %d written", name, len(got), err, size)
		}
	}
	put("tiny", 1000, 10)
	put("grown", 300<<10, 7000) // 64 KiB, doubled up to 512 KiB
	if n := s.pieces.Allocated(); n != 0 {
		t.Errorf("small objects took %d pooled pieces", n)
	}
	put("multi", 2*int(cfg.PartSize)+(3<<20)+5, (1<<20)+3)
	put("again", 2*int(cfg.PartSize)+(3<<20)+5, 4<<20)
	perPart := int((cfg.PartSize + pieceSize - 1) / pieceSize)
	if n := s.pieces.Allocated(); n > int64((cfg.Parallel+1)*perPart) {
		t.Errorf("two objects of 3 parts allocated %d pieces; parts in flight and the one filling need %d", n, (cfg.Parallel+1)*perPart)
	}
	info, err := s.core.StatObject(ctx, "bkt", "pieces/multi", minio.StatObjectOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(info.ETag, "-3") {
		t.Errorf("multi: ETag %q, want 3 parts", info.ETag)
	}
}

// Requests are retried as often as their failure deserves: a refused
// connection (nothing listens) twice, other network errors and server
// errors up to MaxRetries, refusals of the request itself never.
func TestS3Retry(t *testing.T) {
	refusedErr := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	for _, tc := range []struct {
		name  string
		err   error
		calls int
	}{
		{"connection refused", &url.Error{Op: "Put", URL: "http://x", Err: refusedErr}, 1 + refusedRetries},
		{"connection reset", &url.Error{Op: "Put", URL: "http://x", Err: syscall.ECONNRESET}, 4},
		{"server error", minio.ErrorResponse{Code: "InternalError", StatusCode: 500}, 4},
		{"access denied", minio.ErrorResponse{Code: "AccessDenied", StatusCode: 403}, 1},
		// no endpoint set and no network to AWS, or a mistyped host
		{"no such host", &url.Error{Op: "Get", URL: "https://x", Err: &net.OpError{Op: "dial", Net: "tcp",
			Err: &net.DNSError{Err: "no such host", Name: "b.s3.amazonaws.com", IsNotFound: true}}}, 1},
		{"DNS server failure", &url.Error{Op: "Get", URL: "https://x", Err: &net.DNSError{Err: "server misbehaving", Name: "x", IsTemporary: true}}, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &Store{maxRetries: 3}
			calls := 0
			err := s.retry(context.Background(), func(context.Context) error { calls++; return tc.err })
			if err == nil || calls != tc.calls {
				t.Fatalf("retry: %d calls, error %v; want %d calls and an error", calls, err, tc.calls)
			}
		})
	}
}
