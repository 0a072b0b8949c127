package source

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/testwait"
)

var roundTripCodecs = []string{"none", "lz4", "zstd", "zstd:3", "auto", "shuffle"}

const (
	rtChunk = 256 << 10
	dupName = "dup.img"
)

// bigFileSize is the mixed-content file of the round trip: 20 MiB, less
// under -short and -race; GPUCR_TEST_BIG_MIB overrides it.
func bigFileSize() int {
	if v, err := strconv.Atoi(os.Getenv("GPUCR_TEST_BIG_MIB")); err == nil && v > 0 {
		return v << 20
	}
	if testing.Short() {
		return 4 << 20
	}
	if raceEnabled {
		// The race detector slows the codecs tenfold; 8 MiB still makes
		// 32 chunks and several segments.
		return 8 << 20
	}
	return 20 << 20
}

// rtData is what a round trip writes: files written concurrently, and one
// name written twice in sequence (the second must win).
type rtData struct {
	files      map[string][]byte
	dup1, dup2 []byte
}

func makeRTData(bigSize int) *rtData {
	d := &rtData{files: map[string][]byte{
		"pages-1.img": pipelinetest.MixedData(bigSize, 1),
		"empty.img":   {},
	}}
	sizes := []int{1, 2, 100, 4095, 4096, smallRead - 1, smallRead, smallRead + 1, rtChunk - 1, rtChunk, rtChunk + 1,
		2 * rtChunk, 700_000, 3, 5000, 12345, 40_000, 99_999, 150_000, 33}
	for i, n := range sizes {
		d.files[fmt.Sprintf("core-%d.img", i)] = pipelinetest.SmallData(n, uint64(i))
	}
	for i := range 12 {
		d.files[fmt.Sprintf("fdinfo-%d.img", i)] = pipelinetest.SmallData(64+i*97, uint64(100+i))
	}
	d.dup1 = pipelinetest.SmallData(3*rtChunk+17, 5)  // several chunks
	d.dup2 = pipelinetest.SmallData(rtChunk/2+999, 4) // then smaller, different
	return d
}

func (d *rtData) want() map[string][]byte {
	w := map[string][]byte{dupName: d.dup2}
	for n, b := range d.files {
		w[n] = b
	}
	return w
}

// writeAll writes d through c: the files and the first version of the
// duplicate concurrently, then between, then the second version.
func writeAll(c *streamer.Capture, d *rtData, between func() error) error {
	var wg sync.WaitGroup
	errs := make(chan error, len(d.files)+2)
	write := func(name string, r io.Reader, size int, external bool) {
		defer wg.Done()
		n, err := c.WriteFile(name, r, external)
		if err == nil && n != int64(size) {
			err = fmt.Errorf("WriteFile(%s) = %d, want %d", name, n, size)
		}
		errs <- err
	}
	i := 0
	for name, b := range d.files {
		wg.Add(1)
		go write(name, pipelinetest.Reader(b, i), len(b), strings.HasPrefix(name, "fdinfo-1"))
		i++
	}
	wg.Add(1)
	go write(dupName, bytes.NewReader(d.dup1), len(d.dup1), false)
	wg.Wait()
	if between != nil {
		if err := between(); err != nil {
			errs <- err
		}
	}
	if _, err := c.WriteFile(dupName, pipelinetest.Reader(d.dup2, 1), false); err != nil {
		errs <- err
	}
	close(errs)
	var first error
	for err := range errs {
		if err != nil && first == nil {
			first = err
		}
	}
	return first
}

var rtDataOnce = sync.OnceValue(func() *rtData { return makeRTData(bigFileSize()) })

func testOptions(spec string, t testing.TB) pipeline.Options {
	return pipeline.Options{ChunkSize: rtChunk, Workers: 2, MemoryLimit: 8 << 20, Codec: pipelinetest.MustSpec(t, spec)}
}

func TestRoundTrip(t *testing.T) {
	d := rtDataOnce()
	for _, spec := range roundTripCodecs {
		t.Run(spec, func(t *testing.T) {
			// pipeline.Format 3 (the default) and format 1, whose chunks carry BLAKE3 hashes.
			for _, f := range []pipeline.Format{{}, {ChunkHashes: true}} {
				suffix := map[bool]string{false: "", true: "+hashes"}[f.ChunkHashes]
				t.Run("stream-1"+suffix, func(t *testing.T) { streamRoundTrip(t, spec, f, d, 1) })
				t.Run("stream-3"+suffix, func(t *testing.T) { streamRoundTrip(t, spec, f, d, 3) })
				t.Run("archive"+suffix, func(t *testing.T) { archiveRoundTrip(t, spec, f, d) })
			}
		})
	}
}

// liveSource is a StreamSource fed through pipes while the capture runs.
type liveSource struct {
	kind string
	so   StreamSourceOptions
	src  *StreamSource
	prs  []*io.PipeReader
	pws  []*io.PipeWriter
}

func startLive(ctx context.Context, t *testing.T, kind string, so StreamSourceOptions, shards int) *liveSource {
	l := &liveSource{kind: kind, so: so}
	var rs []io.Reader
	var names []string
	for i := range shards {
		pr, pw := io.Pipe()
		l.prs, l.pws = append(l.prs, pr), append(l.pws, pw)
		rs = append(rs, pr)
		names = append(names, fmt.Sprintf("%s shard %d", kind, i))
	}
	l.src = NewStreamSource(ctx, rs, names, so)
	// If the source stops early, fail the capture's writes instead of
	// blocking them forever.
	go func() {
		if err := l.src.Wait(ctx); err != nil {
			for _, pr := range l.prs {
				pr.CloseWithError(fmt.Errorf("%s source stopped: %w", kind, err))
			}
		}
	}()
	t.Cleanup(func() {
		for _, pw := range l.pws {
			pw.CloseWithError(errors.New("test over"))
		}
		l.src.Close()
	})
	return l
}

// waitComplete waits until src holds a complete file name of size bytes,
// whether or not it serves files early.
func waitComplete(ctx context.Context, s *StreamSource, name string, size int64) error {
	for {
		s.mu.Lock()
		f, err, ch := s.complete[name], s.err, s.changed
		s.mu.Unlock()
		if err != nil {
			return err
		}
		if f != nil && f.size == size {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s (%d bytes): %w", name, size, ctx.Err())
		}
	}
}

func streamRoundTrip(t *testing.T, spec string, f pipeline.Format, d *rtData, shards int) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(5*time.Minute))
	defer cancel()
	want := d.want()
	lives := []*liveSource{
		startLive(ctx, t, "memory", StreamSourceOptions{Options: pipeline.Options{Workers: 2, VerifyHashes: true}}, shards),
		startLive(ctx, t, "early", StreamSourceOptions{Options: pipeline.Options{Workers: 2}, ServeEarly: true}, shards),
		startLive(ctx, t, "spill", StreamSourceOptions{Options: pipeline.Options{Workers: 2, MemoryLimit: 1 << 20}, SpillDir: t.TempDir(), ServeEarly: true}, shards),
		startLive(ctx, t, "extract", StreamSourceOptions{Options: pipeline.Options{Workers: 2}, ExtractDir: t.TempDir()}, shards),
	}
	recorded := make([]*bytes.Buffer, shards)
	writers := make([]io.Writer, shards)
	for i := range shards {
		recorded[i] = new(bytes.Buffer)
		ws := []io.Writer{recorded[i]}
		for _, l := range lives {
			ws = append(ws, l.pws[i])
		}
		writers[i] = io.MultiWriter(ws...)
	}
	out, err := streamer.NewStreamOutputAs(writers, f)
	if err != nil {
		t.Fatal(err)
	}
	c, err := streamer.NewCapture(ctx, out, testOptions(spec, t))
	if err != nil {
		t.Fatal(err)
	}
	// Everything, the first version included, is complete in every source
	// before the second version is written, so that sources serving early
	// can be seen to serve the first version first.
	between := func() error {
		for _, l := range lives {
			for name, b := range d.files {
				if err := waitComplete(ctx, l.src, name, int64(len(b))); err != nil {
					return fmt.Errorf("%s: %w", l.kind, err)
				}
			}
			if err := waitComplete(ctx, l.src, dupName, int64(len(d.dup1))); err != nil {
				return fmt.Errorf("%s: %w", l.kind, err)
			}
			if l.so.ServeEarly {
				st, err := l.src.Stat(ctx, dupName)
				if err != nil || st.Size != int64(len(d.dup1)) {
					return fmt.Errorf("%s: Stat(%s) after the first version = %d bytes, %v; want %d", l.kind, dupName, st.Size, err, len(d.dup1))
				}
			}
		}
		return nil
	}
	if err := writeAll(c, d, between); err != nil {
		c.Abort(err)
		_, _ = c.Close(ctx, manifest.Manifest{})
		t.Fatal(err)
	}
	m, err := c.Close(ctx, manifest.Manifest{Tool: "roundtrip-test", ID: "rt"})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range lives {
		for _, pw := range l.pws {
			pw.Close()
		}
	}
	checkManifest(t, m, want, rtChunk)
	if m.NoChunkHashes == f.ChunkHashes {
		t.Fatalf("written as %+v, the manifest says no_chunk_hashes %v", f, m.NoChunkHashes)
	}
	if got := c.Counters.Files.Load(); got != int64(len(want)+1) {
		t.Errorf("pipeline.Counters.Files = %d, want %d", got, len(want)+1)
	}
	for _, l := range lives {
		if err := l.src.Wait(ctx); err != nil {
			t.Fatalf("%s: %v", l.kind, err)
		}
		for i, n := range l.src.ShardBytes() {
			if n != int64(recorded[i].Len()) {
				t.Errorf("%s: ShardBytes[%d] = %d, the shard is %d bytes", l.kind, i, n, recorded[i].Len())
			}
		}
		pipelinetest.CheckSource(t, ctx, l.kind, l.src, want)
		switch l.kind {
		case "extract":
			checkDir(t, l.kind, l.so.ExtractDir, want)
		case "spill":
			l.src.mu.Lock()
			spilled, used := len(l.src.spill.files) > 0, l.src.memUsed
			l.src.mu.Unlock()
			if !spilled && len(d.files["pages-1.img"]) > 2<<20 {
				t.Errorf("spill: a %d-byte limit did not spill", l.so.MemoryLimit)
			}
			if used > l.so.MemoryLimit {
				t.Errorf("spill: %d bytes in memory over the limit of %d", used, l.so.MemoryLimit)
			}
		}
		files, _ := l.src.Files(ctx)
		for _, f := range files {
			if want := m.Files; true {
				mf, _ := (&manifest.Manifest{Files: want}).Lookup(f.Name)
				if mf == nil || mf.Digest != f.Digest || mf.External != f.External {
					t.Fatalf("%s: %s entry %+v disagrees with the manifest", l.kind, f.Name, f)
				}
			}
		}
		if err := l.src.Close(); err != nil {
			t.Fatal(err)
		}
	}
	// Every recorded shard is a complete stream; a single shard carries the
	// manifest in its END frame.
	for i, rec := range recorded {
		sm, err := ScanStream(bytes.NewReader(rec.Bytes()), fmt.Sprintf("shard %d", i))
		if err != nil {
			t.Fatalf("ScanStream(shard %d): %v", i, err)
		}
		if shards == 1 {
			a, _ := m.Marshal()
			b, _ := sm.Marshal()
			if !bytes.Equal(a, b) {
				t.Fatalf("trailer manifest differs from Close's:\n%s\n%s", b, a)
			}
		}
	}
}

func archiveRoundTrip(t *testing.T, spec string, f pipeline.Format, d *rtData) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(5*time.Minute))
	defer cancel()
	want := d.want()
	store := mem.New(t.Name())
	out, err := streamer.NewArchiveOutputAs(ctx, store, 3<<20, f)
	if err != nil {
		t.Fatal(err)
	}
	c, err := streamer.NewCapture(ctx, out, testOptions(spec, t))
	if err != nil {
		t.Fatal(err)
	}
	if err := writeAll(c, d, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := store.Stat(ctx, manifest.ManifestName); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("manifest visible before Close: %v", err)
	}
	if _, err := OpenArchive(ctx, store, pipeline.Options{}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("OpenArchive before Close = %v, want errdefs.ErrNotFound", err)
	}
	m, err := c.Close(ctx, manifest.Manifest{Tool: "roundtrip-test"})
	if err != nil {
		t.Fatal(err)
	}
	checkManifest(t, m, want, rtChunk)
	if m.NoChunkHashes == f.ChunkHashes {
		t.Fatalf("written as %+v, the manifest says no_chunk_hashes %v", f, m.NoChunkHashes)
	}
	if len(m.Segments) < 2 && len(d.files["pages-1.img"]) > 8<<20 {
		t.Errorf("%d segments of at most 3 MiB for over 8 MiB", len(m.Segments))
	}
	// The store holds the segments and the manifest, nothing else.
	wantNames := []string{manifest.ManifestName}
	capture, _ := manifest.SegmentCapture(m.Segments[0].Name)
	for i, s := range m.Segments {
		if c, _ := manifest.SegmentCapture(s.Name); c == "" || c != capture || !strings.HasSuffix(s.Name, fmt.Sprintf("-%08d.gcs", i)) {
			t.Fatalf("segment %d named %s", i, s.Name)
		}
		if got := int64(len(store.Object(s.Name))); got != s.Size {
			t.Fatalf("segment %s: %d bytes stored, manifest says %d", s.Name, got, s.Size)
		}
		// Each segment is a complete stream on its own.
		if _, err := ScanStream(bytes.NewReader(store.Object(s.Name)), s.Name); err != nil {
			t.Fatalf("segment %s does not scan: %v", s.Name, err)
		}
		wantNames = append(wantNames, s.Name)
	}
	if got := store.Names(); strings.Join(got, ",") != strings.Join(wantNames, ",") {
		t.Fatalf("store holds %v, want %v", got, wantNames)
	}
	rm, err := ReadManifest(ctx, store)
	if err != nil {
		t.Fatal(err)
	}
	a1, _ := rm.Marshal()
	a2, _ := m.Marshal()
	if !bytes.Equal(a1, a2) {
		t.Fatalf("stored manifest differs from Close's")
	}
	for _, verify := range []bool{false, true} {
		src, err := OpenArchive(ctx, store, pipeline.Options{Workers: 2, MemoryLimit: 4 << 20, VerifyHashes: verify})
		if err != nil {
			t.Fatal(err)
		}
		pipelinetest.CheckSource(t, ctx, fmt.Sprintf("archive(verify=%v)", verify), src, want)
		if verify {
			rep, err := VerifyArchive(ctx, src)
			if err != nil {
				t.Fatalf("VerifyArchive: %v", err)
			}
			if rep.Files != len(want) {
				t.Fatalf("VerifyArchive checked %d files, want %d", rep.Files, len(want))
			}
		}
		src.Close()
	}
	if _, err := streamer.NewArchiveOutput(ctx, store, 0); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Fatalf("streamer.NewArchiveOutput over a committed archive = %v", err)
	}
}

// With ServeEarly, files may be read while the capture still runs: a file
// is served as soon as it is complete, without waiting for the END frame.
func TestStreamServesBeforeEnd(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	pr, pw := io.Pipe()
	defer pw.Close()
	src := NewStreamSource(ctx, []io.Reader{pr}, []string{"pipe"}, StreamSourceOptions{Options: pipeline.Options{Workers: 2}, ServeEarly: true})
	defer func() { pw.Close(); src.Close() }()
	out, _ := streamer.NewStreamOutput([]io.Writer{pw})
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: rtChunk, Workers: 2, Codec: pipelinetest.MustSpec(t, "lz4")})
	if err != nil {
		t.Fatal(err)
	}
	first := pipelinetest.MixedData(3*rtChunk, 3)
	if _, err := c.WriteFile("inventory.img", bytes.NewReader(first), false); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if _, err := src.Copy(ctx, "inventory.img", &buf); err != nil || !bytes.Equal(buf.Bytes(), first) {
		t.Fatalf("Copy during capture: %v (equal=%v)", err, bytes.Equal(buf.Bytes(), first))
	}
	// A Stat of a file not yet written waits for it.
	got := make(chan error, 1)
	go func() {
		_, err := src.Stat(ctx, "later.img")
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("Stat of a file not yet written returned %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	if _, err := c.WriteFile("later.img", strings.NewReader("later"), false); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		t.Fatal(err)
	}
	if err := src.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	// Only now is a missing file known to be missing.
	if _, err := src.Stat(ctx, "never.img"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Stat(never.img) = %v", err)
	}
}

// An empty capture is a valid, empty checkpoint.
func TestEmptyCapture(t *testing.T) {
	ctx := context.Background()
	var buf bytes.Buffer
	out, _ := streamer.NewStreamOutput([]io.Writer{&buf})
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	m, err := c.Close(ctx, manifest.Manifest{})
	if err != nil || len(m.Files) != 0 {
		t.Fatalf("Close = %+v, %v", m, err)
	}
	src := NewStreamSource(ctx, []io.Reader{&buf}, []string{"buf"}, StreamSourceOptions{})
	defer src.Close()
	pipelinetest.CheckSource(t, ctx, "empty stream", src, map[string][]byte{})

	store := mem.New("empty")
	aout, _ := streamer.NewArchiveOutput(ctx, store, 0)
	c, _ = streamer.NewCapture(ctx, aout, pipeline.Options{Workers: 1})
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		t.Fatal(err)
	}
	a, err := OpenArchive(ctx, store, pipeline.Options{})
	if err != nil {
		t.Fatal(err)
	}
	pipelinetest.CheckSource(t, ctx, "empty archive", a, map[string][]byte{})
}

// WriteFile refuses names no reader would accept.
func TestWriteFileNames(t *testing.T) {
	ctx := context.Background()
	out, _ := streamer.NewStreamOutput([]io.Writer{io.Discard})
	c, _ := streamer.NewCapture(ctx, out, pipeline.Options{Workers: 1})
	defer c.Close(ctx, manifest.Manifest{})
	for _, name := range []string{"", strings.Repeat("x", manifest.MaxNameLen+1)} {
		if _, err := c.WriteFile(name, strings.NewReader("x"), false); err == nil {
			t.Errorf("WriteFile(%q) accepted", name)
		}
	}
}

// A name the capture accepts must be one a stream reader serves.
func TestWriteFileUnsafeNames(t *testing.T) {
	ctx := context.Background()
	for _, name := range []string{"a/b.img", "..", ".", "x\x00y"} {
		var buf bytes.Buffer
		out, _ := streamer.NewStreamOutput([]io.Writer{&buf})
		c, _ := streamer.NewCapture(ctx, out, pipeline.Options{Workers: 1})
		_, werr := c.WriteFile(name, strings.NewReader("data"), false)
		_, cerr := c.Close(ctx, manifest.Manifest{})
		if werr != nil || cerr != nil {
			continue // refused at capture: consistent
		}
		src := NewStreamSource(ctx, []io.Reader{&buf}, []string{"buf"}, StreamSourceOptions{})
		err := src.Wait(ctx)
		src.Close()
		if err != nil {
			t.Errorf("capture accepted %q but the stream reader rejects the stream: %v", name, err)
		}
	}
}

// Without ServeEarly nothing is served before the END frame has been read
// and checked, so a stream damaged anywhere serves nothing.
func TestStreamServesOnlyAfterEnd(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	pr, pw := io.Pipe()
	src := NewStreamSource(ctx, []io.Reader{pr}, []string{"pipe"}, StreamSourceOptions{Options: pipeline.Options{Workers: 2}})
	defer func() { pw.Close(); src.Close() }()
	out, _ := streamer.NewStreamOutput([]io.Writer{pw})
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: rtChunk, Workers: 2, Codec: pipelinetest.MustSpec(t, "zstd")})
	if err != nil {
		t.Fatal(err)
	}
	data := pipelinetest.MixedData(2*rtChunk+5, 8)
	if _, err := c.WriteFile("inventory.img", bytes.NewReader(data), false); err != nil {
		t.Fatal(err)
	}
	if err := waitComplete(ctx, src, "inventory.img", int64(len(data))); err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		_, err := src.Copy(ctx, "inventory.img", io.Discard)
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("Copy returned before the END frame: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	// Abort: the stream ends without END; nothing is served.
	c.Abort(errors.New("producer failed"))
	if _, err := c.Close(ctx, manifest.Manifest{}); err == nil {
		t.Fatal("Close after Abort succeeded")
	}
	pw.Close()
	if err := <-got; err == nil {
		t.Fatal("Copy of a file from a stream without END succeeded")
	}
	if err := src.Wait(ctx); err == nil || !strings.Contains(err.Error(), "truncated") {
		t.Fatalf("Wait = %v, want a truncation error", err)
	}
}

// A name written twice: the later version wins in every reader, whatever
// order the decoders finish in. The stream is replayed from memory, so the
// reader runs far ahead of the decoders.
func TestDuplicateNameReplay(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
	defer cancel()
	var buf bytes.Buffer
	out, _ := streamer.NewStreamOutput([]io.Writer{&buf})
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: rtChunk, Workers: 2, Codec: pipelinetest.MustSpec(t, "zstd:3")})
	if err != nil {
		t.Fatal(err)
	}
	v1 := pipelinetest.MixedData(8*rtChunk, 11)
	v2 := []byte("second version")
	for _, v := range [][]byte{v1, v2} {
		if _, err := c.WriteFile(dupName, bytes.NewReader(v), false); err != nil {
			t.Fatal(err)
		}
	}
	m, err := c.Close(ctx, manifest.Manifest{})
	if err != nil {
		t.Fatal(err)
	}
	if f, _ := m.Lookup(dupName); f == nil || f.Size != int64(len(v2)) {
		t.Fatalf("manifest keeps %+v, want the second version", f)
	}
	for _, mode := range []string{"memory", "extract"} {
		t.Run(mode, func(t *testing.T) {
			for i := range 10 {
				so := StreamSourceOptions{Options: pipeline.Options{Workers: 2}}
				if mode == "extract" {
					so.ExtractDir = t.TempDir()
				}
				src := NewStreamSource(ctx, []io.Reader{bytes.NewReader(buf.Bytes())}, []string{"replay"}, so)
				err := src.Wait(ctx)
				var got bytes.Buffer
				if err == nil {
					_, err = src.Copy(ctx, dupName, &got)
				}
				var dirErr error
				if err == nil && mode == "extract" {
					b, _ := os.ReadFile(so.ExtractDir + "/" + dupName)
					if !bytes.Equal(b, v2) {
						dirErr = fmt.Errorf("extracted file has %d bytes, want the second version's %d", len(b), len(v2))
					}
				}
				src.Close()
				if err != nil || !bytes.Equal(got.Bytes(), v2) || dirErr != nil {
					t.Fatalf("replay %d: err %v, dir %v, served %d bytes, want the second version (%d bytes)", i, err, dirErr, got.Len(), len(v2))
				}
			}
		})
	}
}
