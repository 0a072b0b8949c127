package location

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/streamer"
)

// Given a key, every output location opens sealed and every source
// requires that key; the manifest of an encrypted archive is authenticated
// only with it.
func TestKeyedLocations(t *testing.T) {
	ctx := context.Background()
	key, _ := crypt.ParseKey(strings.Repeat("ab", 32))
	wrong, _ := crypt.ParseKey(strings.Repeat("cd", 32))
	data := bytes.Repeat([]byte("secret page "), 50_000)
	opts := pipeline.Options{ChunkSize: 64 << 10, Workers: 2, MemoryLimit: 64 << 20}
	keyed := func(k *crypt.Key) Config {
		o := opts
		o.Key = k
		return Config{Options: o, BufferLimit: 64 << 20}
	}
	tests := []struct {
		name string
		loc  func(t *testing.T) (Location, *bytes.Buffer)
	}{
		{"archive", func(t *testing.T) (Location, *bytes.Buffer) {
			p := filepath.Join(t.TempDir(), "ckpt")
			return Location{Kind: Archive, Path: p, Raw: p}, nil
		}},
		{"stdio", func(t *testing.T) (Location, *bytes.Buffer) { return Location{Kind: Stdio, Raw: "-"}, &bytes.Buffer{} }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			loc, buf := tc.loc(t)
			c := keyed(key)
			if buf != nil {
				c.Stdout = buf
			}
			out, err := OpenOutput(ctx, loc, c)
			if err != nil {
				t.Fatal(err)
			}
			if seal := out.Format().Seal; seal == nil || seal.Params().KeyID != key.ID() {
				t.Fatal("output opened with a key is not sealed under it")
			}
			capt, err := streamer.NewCapture(ctx, out, c.Options)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := capt.WriteFile("pages-1.img", bytes.NewReader(data), false); err != nil {
				t.Fatal(err)
			}
			if _, err := capt.Close(ctx, manifest.Manifest{Tool: "test"}); err != nil {
				t.Fatal(err)
			}
			if buf != nil && bytes.Contains(buf.Bytes(), []byte("secret page")) {
				t.Fatal("plain bytes in the encrypted stream")
			}
			open := func(c Config) (source.Source, error) {
				if buf != nil {
					c.Stdin = bytes.NewReader(buf.Bytes())
				}
				return OpenSource(ctx, loc, c, source.StreamSourceOptions{})
			}
			read := func(c Config) ([]byte, error) {
				src, err := open(c)
				if err != nil {
					return nil, err
				}
				defer src.Close()
				var got bytes.Buffer
				_, err = src.Copy(ctx, "pages-1.img", &got)
				return got.Bytes(), err
			}
			if _, err := read(keyed(nil)); !errors.Is(err, crypt.ErrNoKey) {
				t.Errorf("read without the key: %v, want ErrNoKey", err)
			}
			if _, err := read(keyed(wrong)); !errors.Is(err, crypt.ErrWrongKey) {
				t.Errorf("read with the wrong key: %v, want ErrWrongKey", err)
			}
			got, err := read(keyed(key))
			if err != nil || !bytes.Equal(got, data) {
				t.Fatalf("read with the key: %d bytes, %v", len(got), err)
			}
			if buf != nil {
				c.Stdin = bytes.NewReader(buf.Bytes())
			}
			m, authenticated, err := ReadManifest(ctx, loc, c)
			if err != nil || m.Encryption == nil || authenticated != (loc.Kind == Archive) {
				t.Fatalf("manifest with the key: authenticated %v, %v", authenticated, err)
			}
			if loc.Kind == Archive {
				if _, _, err := ReadManifest(ctx, loc, keyed(wrong)); !errors.Is(err, crypt.ErrWrongKey) {
					t.Errorf("manifest with the wrong key: %v", err)
				}
				if m, authenticated, err := ReadManifest(ctx, loc, keyed(nil)); err != nil || authenticated || m.Encryption == nil {
					t.Errorf("manifest without the key: authenticated %v, %v", authenticated, err)
				}
			}
		})
	}
}
