package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/knobs"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/streamer"
)

// keyFile writes a key made by keygen to a 0600 file.
func keyFile(t *testing.T) (string, *crypt.Key) {
	t.Helper()
	out, errOut, code := runCmd(t, "keygen")
	if code != exitOK {
		t.Fatalf("keygen: %s", errOut)
	}
	k, err := crypt.ParseKey(out)
	if err != nil {
		t.Fatalf("keygen printed %q: %v", out, err)
	}
	p := filepath.Join(t.TempDir(), "key")
	if err := os.WriteFile(p, []byte(out), 0o600); err != nil {
		t.Fatal(err)
	}
	return p, k
}

// The key is loaded by the commands that take --key-file and no others,
// from the file or GPUCR_KEY; inspect and verify of an encrypted archive
// say which key it needs and whether its manifest was authenticated.
func TestKeyFlags(t *testing.T) {
	kf, key := keyFile(t)
	wf, _ := keyFile(t)
	arch := filepath.Join(t.TempDir(), "ckpt")
	writeEncrypted(t, arch, key)
	id := key.ID().String()
	empty := t.TempDir()
	tests := []struct {
		name     string
		env      string // GPUCR_KEY
		args     []string
		code     int
		stdout   string
		errTexts []string
	}{
		{"ls takes no key", "", []string{"ls", empty, "--key-file", kf}, exitUsage, "", []string{"ls does not take --key-file"}},
		{"ls ignores GPUCR_KEY", "nonsense", []string{"ls", empty}, exitOK, "", nil},
		{"verify loads GPUCR_KEY", "nonsense", []string{"verify", arch}, exitUsage, "", []string{knobs.Key.Name}},
		{"a missing key file", "", []string{"verify", "--key-file", filepath.Join(empty, "none"), arch}, exitUsage, "", []string{"key file"}},
		{"SSE-C without its key file", "", []string{"cp", "s3://bucket/p", empty + "/c", "--s3-sse", "c"}, exitUsage, "", []string{"go together"}},
		{"an unknown SSE mode", "", []string{"cp", "s3://bucket/p", empty + "/c", "--s3-sse", "rot13"}, exitUsage, "", []string{"rot13"}},
		{"inspect without the key", "", []string{"inspect", arch}, exitOK, "key " + id + " (metadata not authenticated: no key given)", nil},
		{"inspect with the key", "", []string{"inspect", "--key-file", kf, arch}, exitOK, "key " + id + " (manifest authenticated)", nil},
		{"inspect with the wrong key", "", []string{"inspect", "--key-file", wf, arch}, exitFailure, "", []string{"wrong key", id}},
		{"verify without the key", "", []string{"verify", arch}, exitFailure, "", []string{id, "--key-file"}},
		{"verify with the key", "", []string{"verify", "--key-file", kf, arch}, exitOK, "ok: 1 files", nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(knobs.Key.Name, tc.env)
			out, errOut, code := runCmd(t, tc.args...)
			if code != tc.code {
				t.Fatalf("exit %d (%s), want %d", code, errOut, tc.code)
			}
			if !strings.Contains(out, tc.stdout) {
				t.Errorf("stdout lacks %q: %s", tc.stdout, out)
			}
			for _, s := range tc.errTexts {
				if !strings.Contains(errOut, s) {
					t.Errorf("error %q lacks %q", errOut, s)
				}
			}
		})
	}
}

// writeEncrypted writes a one-file archive encrypted with key.
func writeEncrypted(t *testing.T, path string, key *crypt.Key) {
	t.Helper()
	ctx := context.Background()
	opts := pipeline.Options{ChunkSize: 64 << 10, Workers: 2, MemoryLimit: 64 << 20, Key: key}
	out, err := location.OpenOutput(ctx, location.Location{Kind: location.Archive, Path: path, Raw: path}, location.Config{Options: opts})
	if err != nil {
		t.Fatal(err)
	}
	c, err := streamer.NewCapture(ctx, out, opts)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.WriteFile("pages-1.img", bytes.NewReader(bytes.Repeat([]byte("page"), 100_000)), false); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Close(ctx, manifest.Manifest{Tool: "test"}); err != nil {
		t.Fatal(err)
	}
}

// --key-file=$(cat key) (the key where its path belongs) does not print
// the key: the message gives the path's length (issue 25).
func TestKeyFileArgumentNotEchoed(t *testing.T) {
	key := crypt.GenerateKey()
	dir := t.TempDir()
	for _, args := range [][]string{
		{"verify", "--key-file=" + key, dir},
		{"checkpoint", "--pid", "1", "--key-file", key, "--to", dir},
	} {
		out, errOut, code := runCmd(t, args...)
		if code == 0 || strings.Contains(out+errOut, key[:16]) || !strings.Contains(errOut, "path of 64 bytes") {
			t.Errorf("%s: exit %d, %q %q; want a failure that names the path by its length only", args[0], code, out, errOut)
		}
	}
}
