package cisformat

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/cisformat/cisformattest"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/testwait"
)

// fixtures are real streams of criu-image-streamer 1.0.0 and the files its
// own extract made of them (testdata/README.md).
var fixtures = []struct {
	name   string
	shards []string
	tar    string
	ext    string // an --ext-file-fds file carried in the stream
}{
	{"one shard", []string{"stream.img"}, "stream.extracted.tar", ""},
	{"two shards", []string{"shard0.img", "shard1.img"}, "shards.extracted.tar", ""},
	{"ext file", []string{"stream-ext.img"}, "stream-ext.extracted.tar", "extra.txt"},
}

func openShards(t *testing.T, names []string) ([]io.Reader, []string) {
	t.Helper()
	var rs []io.Reader
	var labels []string
	for _, n := range names {
		b, err := os.ReadFile(filepath.Join("testdata", n))
		if err != nil {
			t.Fatal(err)
		}
		rs = append(rs, bytes.NewReader(b))
		labels = append(labels, n)
	}
	return rs, labels
}

func TestExtractFixtures(t *testing.T) {
	for _, fx := range fixtures {
		t.Run(fx.name, func(t *testing.T) {
			want := cisformattest.Extracted(t, filepath.Join("testdata", fx.tar))
			if len(want) < 10 {
				t.Fatalf("fixture tar holds %d files", len(want))
			}
			dir := t.TempDir()
			shards, names := openShards(t, fx.shards)
			var ext []string
			if fx.ext != "" {
				ext = []string{fx.ext}
			}
			src := NewSource(context.Background(), shards, names, ext, source.StreamSourceOptions{ExtractDir: dir})
			defer src.Close()
			files, err := src.Files(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			for name, b := range want {
				got, err := os.ReadFile(filepath.Join(dir, name))
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				if !bytes.Equal(got, b) {
					t.Errorf("%s: %d bytes differ from the real tool's %d", name, len(got), len(b))
				}
			}
			listed := map[string]bool{}
			for _, f := range files {
				listed[f.Name] = true
				if _, ok := want[f.Name]; !ok && f.Name != fx.ext {
					t.Errorf("extracted %s, which the real tool did not", f.Name)
				}
				if f.External != (f.Name == fx.ext) {
					t.Errorf("%s: external %v", f.Name, f.External)
				}
			}
			if fx.ext != "" {
				var buf bytes.Buffer
				if _, err := src.Copy(context.Background(), fx.ext, &buf); err != nil {
					t.Fatal(err)
				}
				wantExt, err := os.ReadFile(filepath.Join("testdata", fx.ext))
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(buf.Bytes(), wantExt) {
					t.Errorf("ext file: got %q, want %q", buf.Bytes(), wantExt)
				}
			}
			// The real tool's "size" is every byte read from each shard.
			var total int64
			for i, st := range src.ShardStats() {
				fi, err := os.Stat(filepath.Join("testdata", fx.shards[i]))
				if err != nil {
					t.Fatal(err)
				}
				if st.Size != fi.Size() {
					t.Errorf("shard %d: size %d, file holds %d", i, st.Size, fi.Size())
				}
				total += st.Size
			}
			if total == 0 {
				t.Error("no bytes counted")
			}
		})
	}
}

// TestServeFixtureInMemory serves files from memory (no extract dir), the
// way serve hands them to CRIU, and a file is served twice.
func TestServeFixtureInMemory(t *testing.T) {
	want := cisformattest.Extracted(t, "testdata/shards.extracted.tar")
	shards, names := openShards(t, []string{"shard0.img", "shard1.img"})
	src := NewSource(context.Background(), shards, names, nil, source.StreamSourceOptions{})
	defer src.Close()
	for _, name := range []string{"inventory.img", "pages-1.img", "inventory.img"} {
		var buf bytes.Buffer
		if _, err := src.Copy(context.Background(), name, &buf); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf.Bytes(), want[name]) {
			t.Errorf("%s differs", name)
		}
	}
	if _, err := src.Stat(context.Background(), "memfd.img"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("absent file: %v", err)
	}
}

// TestDamagedStreams: every kind of damage is an ErrCorrupt naming the shard
// and the offset, and nothing partial is left in the extract dir.
func TestDamagedStreams(t *testing.T) {
	good, err := os.ReadFile("testdata/stream.img")
	if err != nil {
		t.Fatal(err)
	}
	var s []byte
	s = AppendMarker(s, Marker{Seq: 0, Kind: Filename, Name: "a.img"})
	s = AppendMarker(s, Marker{Seq: 1, Kind: FileData, Size: 3})
	s = append(s, "abc"...)
	s = AppendMarker(s, Marker{Seq: 2, Kind: FileEOF})
	s = AppendMarker(s, Marker{Seq: 3, Kind: ImageEOF})
	small := s
	mk := func(ms ...Marker) []byte {
		var b []byte
		for _, m := range ms {
			b = AppendMarker(b, m)
		}
		return b
	}
	cases := []struct {
		name   string
		shards [][]byte
		where  string
	}{
		{"truncated in data", [][]byte{good[:5000]}, "s0 at offset"},
		{"truncated in a marker", [][]byte{small[:len(small)-3]}, "s0 at offset"},
		{"no image_eof", [][]byte{small[:len(small)-8]}, "before the image_eof"},
		{"huge marker length", [][]byte{{0xff, 0xff, 0, 0, 8}}, "s0 at offset 0"},
		{"data after image_eof", [][]byte{append(append([]byte{}, small...), mk(Marker{Seq: 4, Kind: ImageEOF})...)}, "after the image_eof"},
		{"gap in seq", [][]byte{mk(Marker{Seq: 0, Kind: Filename, Name: "a"}, Marker{Seq: 2, Kind: FileEOF})}, "missing"},
		{"seq twice", [][]byte{mk(Marker{Seq: 0, Kind: Filename, Name: "a"}), mk(Marker{Seq: 0, Kind: Filename, Name: "b"})}, "sequence number"},
		{"data without a file", [][]byte{mk(Marker{Seq: 0, Kind: FileData, Size: 0})}, "no file selected"},
		{"unsafe name", [][]byte{mk(Marker{Seq: 0, Kind: Filename, Name: "../x"})}, "unsafe"},
		{"open at image_eof", [][]byte{mk(Marker{Seq: 0, Kind: Filename, Name: "a"}, Marker{Seq: 1, Kind: ImageEOF})}, "still open"},
		{"bad protobuf", [][]byte{{3, 0, 0, 0, 0x08, 0xff, 0xff}}, "s0 at offset 0"},
		{"no body", [][]byte{{2, 0, 0, 0, 0x08, 0x05}}, "no body"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			var rs []io.Reader
			var names []string
			for i, b := range c.shards {
				rs = append(rs, bytes.NewReader(b))
				names = append(names, "s"+string(rune('0'+i)))
			}
			src := NewSource(context.Background(), rs, names, nil, source.StreamSourceOptions{ExtractDir: dir})
			_, err := src.Files(context.Background())
			src.Close()
			if !errors.Is(err, errdefs.ErrCorrupt) {
				t.Fatalf("got %v, want ErrCorrupt", err)
			}
			if !strings.Contains(err.Error(), c.where) {
				t.Errorf("error %q does not say %q", err, c.where)
			}
			left, _ := os.ReadDir(dir)
			for _, e := range left {
				t.Errorf("left %s in the extract dir", e.Name())
			}
		})
	}
}

func TestDetect(t *testing.T) {
	for _, n := range []string{"stream.img", "shard0.img", "shard1.img", "stream-ext.img"} {
		b, err := os.ReadFile(filepath.Join("testdata", n))
		if err != nil {
			t.Fatal(err)
		}
		if !Detect(b[:PrefixLen]) {
			t.Errorf("%s not detected", n)
		}
	}
	for _, b := range [][]byte{[]byte("GPUCRSTM"), {0, 0, 0, 0, 8}, {1, 0, 0, 0, 8}, {5, 0, 0, 0, 0x30}, []byte("PK\x03\x04x"), {4, 0, 0}} {
		if Detect(b) {
			t.Errorf("%q detected", b)
		}
	}
}

// TestCloseWhileWaiting: a source whose shard stalls, between markers or
// inside a file's data, closes at once, with no goroutine left behind.
func TestCloseWhileWaiting(t *testing.T) {
	var between, inData []byte
	between = AppendMarker(between, Marker{Seq: 0, Kind: Filename, Name: "a.img"})
	inData = AppendMarker(append([]byte{}, between...), Marker{Seq: 1, Kind: FileData, Size: 3})
	inData = append(inData, 'a') // 2 data bytes never come
	for _, s := range [][]byte{between, inData} {
		closeStalled(t, s)
	}
}

func closeStalled(t *testing.T, s []byte) {
	pr, pw := io.Pipe()
	go func() { pw.Write(s) }() // then silence
	src := NewSource(context.Background(), []io.Reader{pr}, []string{"live"}, nil, source.StreamSourceOptions{})
	time.Sleep(50 * time.Millisecond)
	done := make(chan struct{})
	go func() {
		src.Close()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(testwait.Scale(5 * time.Second)):
		t.Fatal("Close hangs on a stalled stream")
	}
	pw.Close()
}
