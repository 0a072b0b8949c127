package s3

import (
	"bytes"
	"context"
	"encoding/hex"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/store/miniotest"
	"github.com/gpucr/gpucr-stream/testwait"
	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/encrypt"
)

func TestParseSSE(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want SSE
		err  bool
	}{
		{"", SSE{}, false},
		{"none", SSE{}, false},
		{"s3", SSE{Mode: SSES3}, false},
		{"AES256", SSE{Mode: SSES3}, false},
		{"kms", SSE{Mode: SSEKMS}, false},
		{"kms:arn:aws:kms:eu-west-1:1:key/abc", SSE{Mode: SSEKMS, KMSKeyID: "arn:aws:kms:eu-west-1:1:key/abc"}, false},
		{"c", SSE{Mode: SSEC}, false},
		{"c:0011", SSE{}, true}, // never a key in the flag
		{"rot13", SSE{}, true},
	} {
		got, err := ParseSSE(tc.in)
		if tc.in == "c:0011" {
			// The key part is ignored, not taken: the flag cannot carry it.
			if err != nil || got.Mode != SSEC || got.CustomerKey != nil {
				t.Errorf("ParseSSE(%q) = %+v, %v", tc.in, got, err)
			}
			continue
		}
		if (err != nil) != tc.err || (err == nil && (got.Mode != tc.want.Mode || got.KMSKeyID != tc.want.KMSKeyID)) {
			t.Errorf("ParseSSE(%q) = %+v, %v; want %+v, error %v", tc.in, got, err, tc.want, tc.err)
		}
	}
}

// SSE-C over plain http would send the key in clear: refused before any
// request.
func TestS3SSECNeedsTLS(t *testing.T) {
	clearAWSEnv(t)
	cfg := Config{Endpoint: "http://127.0.0.1:1", Bucket: "b", AccessKey: "a", SecretKey: "s", SSE: SSE{Mode: SSEC, CustomerKey: make([]byte, 32)}}
	_, err := New(context.Background(), cfg)
	if err == nil || !strings.Contains(err.Error(), "https") {
		t.Fatalf("New with SSE-C over http: %v", err)
	}
}

// Every mode against a real MinIO: a single-PUT object and a multipart one
// are written, read back whole and by range, and the server says it stored
// them encrypted the way asked; an SSE-C object cannot be read without its
// key, nor with another.
func TestS3ServerSideEncryption(t *testing.T) {
	clearAWSEnv(t)
	ssec := bytes.Repeat([]byte{0x42}, 32)
	for _, tc := range []struct {
		name   string
		opts   miniotest.Options
		sse    SSE
		header string // x-amz-server-side-encryption the server reports
	}{
		{"SSE-S3", miniotest.Options{KMS: true}, SSE{Mode: SSES3}, "AES256"},
		{"SSE-KMS", miniotest.Options{KMS: true}, SSE{Mode: SSEKMS, KMSKeyID: miniotest.KMSKeyID}, "aws:kms"},
		{"SSE-C", miniotest.Options{TLS: true}, SSE{Mode: SSEC, CustomerKey: ssec}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := miniotest.StartWith(t, tc.opts)
			srv.MakeBucket(t, "enc")
			if tc.opts.TLS {
				t.Setenv("AWS_CA_BUNDLE", srv.CAFile())
			}
			cfg := testConfig(srv, "enc", "p")
			cfg.SSE = tc.sse
			s := newTestS3(t, cfg)
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
			defer cancel()
			small := bytes.Repeat([]byte("small object "), 100)
			big := make([]byte, 2*minS3PartSize+12345)
			for i := range big {
				big[i] = byte(i * 7)
			}
			for name, data := range map[string][]byte{"small": small, "big": big} {
				w, err := s.Create(ctx, name)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := w.Write(data); err != nil {
					t.Fatal(err)
				}
				if err := w.Commit(ctx); err != nil {
					t.Fatalf("commit %s: %v", name, err)
				}
				info, err := s.Stat(ctx, name)
				if err != nil || info.Size != int64(len(data)) {
					t.Fatalf("stat %s: %+v, %v", name, info, err)
				}
				for _, r := range [][2]int64{{0, -1}, {5, 100}, {int64(len(data)) - 10, 10}} {
					rc, err := s.Open(ctx, name, r[0], r[1])
					if err != nil {
						t.Fatalf("open %s %v: %v", name, r, err)
					}
					got, err := io.ReadAll(rc)
					rc.Close()
					end := int64(len(data))
					if r[1] >= 0 {
						end = r[0] + r[1]
					}
					if err != nil || !bytes.Equal(got, data[r[0]:end]) {
						t.Fatalf("read %s %v: %d bytes, %v", name, r, len(got), err)
					}
				}
				raw := srv.Client(t)
				key := "p/" + name
				oi, err := raw.StatObject(ctx, "enc", key, minio.StatObjectOptions{})
				if tc.sse.Mode == SSEC {
					if err == nil {
						t.Fatalf("%s: an SSE-C object was read without its key", name)
					}
					other, _ := encrypt.NewSSEC(bytes.Repeat([]byte{1}, 32))
					if _, err := raw.StatObject(ctx, "enc", key, minio.StatObjectOptions{ServerSideEncryption: other}); err == nil {
						t.Fatalf("%s: an SSE-C object was read with another key", name)
					}
					right, _ := encrypt.NewSSEC(ssec)
					if oi, err = raw.StatObject(ctx, "enc", key, minio.StatObjectOptions{ServerSideEncryption: right}); err != nil {
						t.Fatalf("%s: stat with the SSE-C key: %v", name, err)
					}
					if oi.Metadata.Get("X-Amz-Server-Side-Encryption-Customer-Algorithm") != "AES256" {
						t.Fatalf("%s: server reports %v", name, oi.Metadata)
					}
					continue
				}
				if err != nil {
					t.Fatal(err)
				}
				if got := oi.Metadata.Get("X-Amz-Server-Side-Encryption"); got != tc.header {
					t.Fatalf("%s: server reports encryption %q, want %q (%v)", name, got, tc.header, oi.Metadata)
				}
				if tc.sse.Mode == SSEKMS && !strings.Contains(oi.Metadata.Get("X-Amz-Server-Side-Encryption-Aws-Kms-Key-Id"), miniotest.KMSKeyID) {
					t.Fatalf("%s: KMS key id %q, want %s", name, oi.Metadata.Get("X-Amz-Server-Side-Encryption-Aws-Kms-Key-Id"), miniotest.KMSKeyID)
				}
			}
		})
	}
}

// LoadSSE takes the SSE-C key from its file, with SSE-C and nothing else,
// from a file only its owner may read.
func TestLoadSSE(t *testing.T) {
	dir := t.TempDir()
	key := bytes.Repeat([]byte{7}, 32)
	write := func(name string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(hex.EncodeToString(key)+"\n"), mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good, open := write("key", 0o600), write("open", 0o644)
	for _, tc := range []struct {
		spec, file string
		errText    string // "": accepted
	}{
		{"c", good, ""},
		{"s3", "", ""},
		{"", "", ""},
		{"c", "", "go together"},
		{"s3", good, "go together"},
		{"c", open, "chmod 600"},
		{"c", filepath.Join(dir, "none"), "no such file"},
	} {
		sse, err := LoadSSE(tc.spec, tc.file)
		if tc.errText == "" {
			if err != nil || (sse.Mode == SSEC) != bytes.Equal(sse.CustomerKey, key) {
				t.Errorf("LoadSSE(%q, %q) = %+v, %v", tc.spec, tc.file, sse.Mode, err)
			}
		} else if err == nil || !strings.Contains(err.Error(), tc.errText) {
			t.Errorf("LoadSSE(%q, %q): %v, want an error with %q", tc.spec, tc.file, err, tc.errText)
		}
	}
}
