package ctrtar

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/streamer"
)

// entry is one member of a test archive.
type entry struct {
	name, body string
	typ        byte
}

func archive(t testing.TB, entries []entry) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Mode: 0o600, Size: int64(len(e.body)), Typeflag: e.typ}
		if e.typ == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Typeflag != tar.TypeReg {
			h.Size = 0
			h.Linkname = e.body
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			tw.Write([]byte(e.body))
		}
	}
	tw.Close()
	return b.Bytes()
}

// podmanLike is what `podman container checkpoint --export` writes.
var podmanLike = []entry{
	{name: "artifacts/", typ: tar.TypeDir},
	{name: "config.dump", body: `{"id":"abc","name":"web","rootfsImageName":"localhost/img:1","createdTime":"2026-01-01T00:00:00Z"}`},
	{name: "spec.dump", body: `{"ociVersion":"1.0.2","annotations":{"io.container.manager":"libpod"}}`},
	{name: "network.status", body: "[]"},
	{name: "rootfs-diff.tar", body: "not really a tar"},
	{name: "checkpoint/", typ: tar.TypeDir},
	{name: "checkpoint/descriptors.json", body: `["/dev/null","/dev/null","/dev/null"]`},
	{name: "checkpoint/pages-1.img", body: strings.Repeat("p", 100000)},
	{name: "checkpoint/stats-dump", body: "stats"},
	{name: "checkpoint/inventory.img", body: "inv"},
	{name: "checkpoint/streamer-serve.sock", typ: tar.TypeSymlink, body: "/run/x/streamer-serve.sock"},
}

// importInto imports b into a checkpoint held in memory and opens it.
func importInto(t testing.TB, b []byte) (*Meta, source.Source, error) {
	t.Helper()
	ctx := context.Background()
	var stream bytes.Buffer
	out, err := streamer.NewStreamOutput([]io.Writer{&stream})
	if err != nil {
		t.Fatal(err)
	}
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: 64 << 10, Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	m, err := Import(ctx, bytes.NewReader(b), c)
	if err != nil {
		c.Abort(err)
		c.Close(ctx, manifest.Manifest{})
		return nil, nil, err
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		t.Fatal(err)
	}
	src := source.NewStreamSource(ctx, []io.Reader{&stream}, []string{"stream"}, source.StreamSourceOptions{})
	t.Cleanup(func() { src.Close() })
	return m, src, nil
}

// TestRoundTrip: an archive of Podman's layout, imported and exported
// again, compressed each way, holds the same files in the same places;
// the engine's files and descriptors.json are carried, CRIU's images
// not, and config.dump names the container.
func TestRoundTrip(t *testing.T) {
	ctx := context.Background()
	for _, comp := range []Compression{None, Gzip, Zstd} {
		m, src, err := importInto(t, archive(t, podmanLike))
		if err != nil {
			t.Fatal(err)
		}
		if m.Engine != "podman" || m.Config == nil || m.Config.Name != "web" || m.Config.RootfsImageName != "localhost/img:1" {
			t.Fatalf("meta %+v %+v", m, m.Config)
		}
		files, err := src.Files(ctx)
		if err != nil {
			t.Fatal(err)
		}
		carried := map[string]bool{}
		for _, f := range files {
			carried[f.Name] = f.Carried
		}
		for name, want := range map[string]bool{"config.dump": true, "spec.dump": true, "network.status": true, "rootfs-diff.tar": true,
			"descriptors.json": true, "pages-1.img": false, "inventory.img": false, "stats-dump": false} {
			if got, ok := carried[name]; !ok || got != want {
				t.Errorf("%s: listed %v, carried %v; want carried %v", name, ok, got, want)
			}
		}
		var out bytes.Buffer
		if err := Export(ctx, src, &out, comp); err != nil {
			t.Fatal(err)
		}
		// Read back as Import reads it: the same members, where they were.
		tr, closeTar, err := decompress(&out)
		if err != nil {
			t.Fatal(err)
		}
		rd := tar.NewReader(tr)
		got := map[string]string{}
		for {
			h, err := rd.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(rd)
			got[h.Name] = string(b)
		}
		closeTar()
		for _, e := range podmanLike {
			if e.typ != 0 {
				continue
			}
			if got[e.name] != e.body {
				t.Errorf("compression %d: %s: %d bytes back, want %d", comp, e.name, len(got[e.name]), len(e.body))
			}
		}
	}
}

func TestImportRefuses(t *testing.T) {
	inv := entry{name: "checkpoint/inventory.img", body: "inv"}
	for _, tc := range []struct {
		name    string
		entries []entry
		kind    error
	}{
		{"volume", []entry{inv, {name: "volumes/data.tar", body: "x"}}, errdefs.ErrUsage},
		{"hard link", []entry{inv, {name: "checkpoint/x.img", typ: tar.TypeLink, body: "checkpoint/inventory.img"}}, errdefs.ErrUsage},
		{"device", []entry{inv, {name: "dev", typ: tar.TypeChar}}, errdefs.ErrUsage},
		{"twice", []entry{inv, {name: "checkpoint/inventory.img", body: "again"}}, errdefs.ErrCorrupt},
		{"same name beside", []entry{inv, {name: "inventory.img", body: "x"}}, errdefs.ErrCorrupt},
		{"escape", []entry{inv, {name: "../../etc/passwd", body: "x"}}, errdefs.ErrUsage},
		{"no inventory", []entry{{name: "checkpoint/pages-1.img", body: "x"}}, errdefs.ErrCorrupt},
		{"not a tar", nil, errdefs.ErrCorrupt},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := []byte("this is no archive at all, just text that is long enough")
			if tc.entries != nil {
				b = archive(t, tc.entries)
			}
			if _, _, err := importInto(t, b); !errors.Is(err, tc.kind) {
				t.Fatalf("got %v, want %v", err, tc.kind)
			}
		})
	}
}

func TestCompressionFor(t *testing.T) {
	for name, want := range map[string]Compression{"a.tar": None, "a.tar.gz": Gzip, "a.tgz": Gzip, "a.tar.zst": Zstd, "a.tar.zstd": Zstd} {
		if got, ok := CompressionFor(name); !ok || got != want {
			t.Errorf("%s: %v %v", name, got, ok)
		}
	}
	if _, ok := CompressionFor("/loc/ckpt"); ok {
		t.Error("a location named as an archive")
	}
	if !Sniff(archive(t, podmanLike)) || Sniff([]byte("GPUCRSTM")) {
		t.Error("Sniff")
	}
}

// discard is a Sink that reads every file to its end, or fails one over
// 1 MiB: a few bytes of zstd may stand for gigabytes, which a real
// import takes (a checkpoint may be that large) and a fuzzer need not.
type discard struct{ files int }

func (d *discard) WriteFile(_ string, r io.Reader, _ bool) (int64, error) {
	d.files++
	n, err := io.Copy(io.Discard, io.LimitReader(r, 1<<20+1))
	if err == nil && n > 1<<20 {
		err = errors.New("over 1 MiB")
	}
	return n, err
}
func (d *discard) WriteCarried(name string, r io.Reader) (int64, error) {
	return d.WriteFile(name, r, true)
}

// FuzzImport: whatever an archive holds, Import imports it or refuses it
// with an error, without a panic, and takes no more files than it holds.
func FuzzImport(f *testing.F) {
	f.Add(archive(f, podmanLike))
	f.Add([]byte{0x1f, 0x8b, 8, 0})
	f.Add([]byte{0x28, 0xb5, 0x2f, 0xfd, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		var d discard
		m, err := Import(context.Background(), bytes.NewReader(b), &d)
		if err == nil && m.Files != d.files {
			t.Fatalf("%d files imported, %d taken", m.Files, d.files)
		}
	})
}
