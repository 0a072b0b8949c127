package e2e

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/knobs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store/miniotest"
	"github.com/minio/minio-go/v7"
)

// writeKey makes a key file with gpucr-stream keygen, mode 0600.
func writeKey(ctx context.Context, t *testing.T, path string) *crypt.Key {
	t.Helper()
	r := gcsRun(ctx, t, "keygen").ok(t, "keygen")
	if err := os.WriteFile(path, []byte(r.stdout), 0o600); err != nil {
		t.Fatal(err)
	}
	k, err := crypt.LoadKeyFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

type inspected struct {
	Encryption *struct {
		KeyID         string `json:"key_id"`
		Authenticated bool   `json:"authenticated"`
	} `json:"encryption"`
	Files []struct {
		Name string `json:"name"`
	} `json:"files"`
}

func inspectJSON(ctx context.Context, t *testing.T, args ...string) inspected {
	t.Helper()
	r := gcsRun(ctx, t, append([]string{"inspect", "--json"}, args...)...).ok(t, "inspect")
	var in inspected
	if err := json.Unmarshal([]byte(r.stdout), &in); err != nil {
		t.Fatalf("inspect --json: %v: %s", err, r.stdout)
	}
	return in
}

// failsNaming checks that a run failed with exit code code and said all of want.
func failsNaming(t *testing.T, what string, r gcsResult, code int, want ...string) {
	t.Helper()
	if r.code != code {
		t.Fatalf("%s: exit %d, want %d\nstderr: %s", what, r.code, code, r.stderr)
	}
	for _, w := range want {
		if !strings.Contains(r.stderr, w) {
			t.Fatalf("%s: stderr does not say %q:\n%s", what, w, r.stderr)
		}
	}
}

// TestS3EncryptedCheckpointRestore: `checkpoint --key-file` into MinIO with
// SSE-S3 on top; the objects hold no plain image bytes and the server
// stored them encrypted; inspect reads the metadata without the key (not
// authenticated) and with it (authenticated); verify and restore refuse a
// missing or wrong key naming the key they need; restore with the key in
// GPUCR_KEY brings the target back; a manifest changed afterwards fails
// verify as corrupt.
func TestS3EncryptedCheckpointRestore(t *testing.T) {
	e := startS3With(t, miniotest.Options{KMS: true})
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	t.Setenv(knobs.Key.Name, "")
	os.Unsetenv(knobs.Key.Name)
	keyFile, wrongFile := filepath.Join(dir, "key"), filepath.Join(dir, "wrong")
	key, wrong := writeKey(ctx, t, keyFile), writeKey(ctx, t, wrongFile)
	tg, before := startedTarget(ctx, t, dir, 128)
	url := e.url("sec/ck1")

	gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", url, "--key-file", keyFile, "--s3-sse", "s3",
		"--work-dir", filepath.Join(dir, "w1")).ok(t, "checkpoint")
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatal(err)
	}

	// At rest: SSE-S3 on every object, and an encrypted manifest naming the key.
	client := e.srv.Client(t)
	keys := e.keys(ctx, t, "sec/ck1/")
	if len(keys) < 2 {
		t.Fatalf("objects %v", keys)
	}
	for _, k := range keys {
		oi, err := client.StatObject(ctx, s3Bucket, k, minio.StatObjectOptions{})
		if err != nil || oi.Metadata.Get("X-Amz-Server-Side-Encryption") != "AES256" {
			t.Fatalf("%s: server-side encryption %q, %v", k, oi.Metadata.Get("X-Amz-Server-Side-Encryption"), err)
		}
	}
	doc := getObject(ctx, t, client, "sec/ck1/manifest.json")
	m, err := manifest.Parse(doc)
	if err != nil || m.Encryption == nil || m.Encryption.KeyID.String() != key.ID().String() || m.Format != manifest.VersionEncrypted {
		t.Fatalf("manifest: %v, encryption %+v", err, m.Encryption)
	}

	in := inspectJSON(ctx, t, url)
	if in.Encryption == nil || in.Encryption.KeyID != key.ID().String() || in.Encryption.Authenticated || len(in.Files) < 10 {
		t.Fatalf("inspect without key: %+v", in)
	}
	if in := inspectJSON(ctx, t, "--key-file", keyFile, url); in.Encryption == nil || !in.Encryption.Authenticated {
		t.Fatalf("inspect with key: %+v", in.Encryption)
	}
	failsNaming(t, "verify without key", gcsRun(ctx, t, "verify", url), 1, key.ID().String(), "--key-file")
	failsNaming(t, "verify with the wrong key", gcsRun(ctx, t, "verify", "--key-file", wrongFile, url), 1, key.ID().String(), wrong.ID().String())
	failsNaming(t, "restore with the wrong key", gcsRun(ctx, t, "restore", "--key-file", wrongFile, "--from", url, "--work-dir", filepath.Join(dir, "w2")), 1,
		key.ID().String(), wrong.ID().String())
	gcsRun(ctx, t, "verify", "--key-file", keyFile, url).ok(t, "verify")

	// No plain image bytes in any object: windows of the extracted images
	// are searched for in the stored ones.
	x := mkdir(t, filepath.Join(dir, "x"))
	gcsRun(ctx, t, "--images-dir", x, "extract", "--key-file", keyFile, "--from", url).ok(t, "extract")
	var stored [][]byte
	for _, k := range keys {
		stored = append(stored, getObject(ctx, t, client, k))
	}
	ents, _ := os.ReadDir(x)
	searched := 0
	for _, ent := range ents {
		b, _ := os.ReadFile(filepath.Join(x, ent.Name()))
		for off := 0; off+64 <= len(b) && off < 1<<20; off += 4096 {
			w := b[off : off+64]
			if bytes.Count(w, w[:1]) == len(w) {
				continue // runs of one byte prove nothing
			}
			searched++
			for i, s := range stored {
				if bytes.Contains(s, w) {
					t.Fatalf("%s holds 64 plain bytes of %s at offset %d", keys[i], ent.Name(), off)
				}
			}
		}
	}
	if searched < 20 {
		t.Fatalf("only %d windows searched", searched)
	}

	t.Setenv(knobs.Key.Name, strings.TrimSpace(string(must(os.ReadFile(keyFile)))))
	rr := gcsRun(ctx, t, "restore", "--from", url, "--work-dir", filepath.Join(dir, "w3")).ok(t, "restore")
	if pid, _ := strconv.Atoi(strings.TrimSpace(rr.stdout)); pid != tg.PID() {
		t.Fatalf("restore printed %q, want pid %d", rr.stdout, tg.PID())
	}
	provenRestore(ctx, t, tg, before)

	// A manifest changed by someone without the key (its CRC fixed).
	m.Labels = map[string]string{"tampered": "yes"}
	bad, err := m.MarshalMAC(func([]byte) []byte { b, _ := hexBytes(m.MAC); return b })
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.PutObject(ctx, s3Bucket, "sec/ck1/manifest.json", bytes.NewReader(bad), int64(len(bad)), minio.PutObjectOptions{}); err != nil {
		t.Fatal(err)
	}
	failsNaming(t, "verify of a tampered manifest", gcsRun(ctx, t, "verify", url), 3, "MAC")
}

// TestEncryptedStreamStdout: capture --key-file to stdout, the stream file
// is served from stdin with the key; serve with another key refuses it.
func TestEncryptedStreamStdout(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	t.Setenv(knobs.Key.Name, "")
	os.Unsetenv(knobs.Key.Name)
	keyFile, wrongFile := filepath.Join(dir, "key"), filepath.Join(dir, "wrong")
	key, _ := writeKey(ctx, t, keyFile), writeKey(ctx, t, wrongFile)
	tg, before := startedTarget(ctx, t, dir, 64)

	streamPath := filepath.Join(dir, "ckpt.stream")
	out, err := os.OpenFile(streamPath, os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	a := mkdir(t, filepath.Join(dir, "a"))
	capture := startGCS(ctx, t, gcsOpts{stdout: out}, "--images-dir", a, "capture", "--key-file", keyFile)
	dumpThrough(ctx, t, tg, a, capture)
	out.Close()

	in := inspectJSON(ctx, t, streamPath)
	if in.Encryption == nil || in.Encryption.KeyID != key.ID().String() {
		t.Fatalf("inspect of the stream: %+v", in.Encryption)
	}
	failsNaming(t, "verify with the wrong key", gcsRun(ctx, t, "verify", "--key-file", wrongFile, streamPath), 1, key.ID().String())
	gcsRun(ctx, t, "verify", "--key-file", keyFile, streamPath).ok(t, "verify")

	restoreStream(ctx, t, dir, streamPath, "--key-file", keyFile)
	provenRestore(ctx, t, tg, before)
}

func getObject(ctx context.Context, t *testing.T, c *minio.Client, key string) []byte {
	t.Helper()
	o, err := c.GetObject(ctx, s3Bucket, key, minio.GetObjectOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	b, err := io.ReadAll(o)
	if err != nil {
		t.Fatalf("get %s: %v", key, err)
	}
	return b
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func hexBytes(s string) ([]byte, error) { return hex.DecodeString(s) }

// TestMigrateNetnsEncrypted: migrate --key-file between two network
// namespaces to a receiver holding the key; the stream and the sender's
// local copy share one session, and the restored target proves its memory.
func TestMigrateNetnsEncrypted(t *testing.T) {
	e := newMigrateEnv(t)
	keyFile := filepath.Join(e.dir, "key")
	writeKey(e.ctx, t, keyFile)
	tg, before := e.startTarget("target", 96)
	keep := mkdir(t, filepath.Join(e.dir, "keep"))
	var res migrateJSON
	e.migrated(tg, []string{"--key-file", keyFile}, []string{"--keep-dir", keep, "--key-file", keyFile}, &res, nil)
	if res.RestoredPID != tg.PID() || res.RawBytes < 64<<20 {
		t.Fatalf("migrate says %+v, target pid %d", res, tg.PID())
	}
	emptyDir(t, keep)
	provenRestore(e.ctx, t, tg, before)
}
