package source

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/testwait"
)

const corpusChunk = 64 << 10

// corpusFiles are small, but cover every codec path: text (compressed),
// noise (stored raw), zeros (Zero), several chunks, an empty file.
func corpusFiles() map[string][]byte {
	pages := make([]byte, 4*corpusChunk+1000)
	r := pipelinetest.NewRand(42)
	pipelinetest.FillText(pages[:corpusChunk], r)
	pipelinetest.FillRandom(pages[corpusChunk:2*corpusChunk], r)
	// chunk 2 stays zero
	pipelinetest.FillBF16(pages[3*corpusChunk:], r)
	return map[string][]byte{
		"inventory.img": pipelinetest.SmallData(3000, 0),
		"pages-1.img":   pages,
		"core-1.img":    pipelinetest.SmallData(corpusChunk+77, 3),
		"noise.img":     pipelinetest.SmallData(5000, 1),
		"empty.img":     {},
	}
}

// barrierReader holds every file's first read until all files have made
// theirs: every FILE frame is then written before any DATA frame, which
// keeps the corpus layout the same from run to run.
type barrierReader struct {
	r       io.Reader
	wg      *sync.WaitGroup
	started bool
}

func (b *barrierReader) Read(p []byte) (int, error) {
	if !b.started {
		b.started = true
		b.wg.Done()
		b.wg.Wait()
	}
	return b.r.Read(p)
}

// captureFiles writes files through a capture into out, all at once.
func captureFiles(t testing.TB, ctx context.Context, out streamer.Output, opts pipeline.Options, files map[string][]byte) *manifest.Manifest {
	t.Helper()
	c, err := streamer.NewCapture(ctx, out, opts)
	if err != nil {
		t.Fatal(err)
	}
	var barrier, done sync.WaitGroup
	barrier.Add(len(files))
	errs := make(chan error, len(files))
	for name, data := range files {
		done.Add(1)
		go func() {
			defer done.Done()
			_, err := c.WriteFile(name, &barrierReader{r: bytes.NewReader(data), wg: &barrier}, false)
			errs <- err
		}()
	}
	done.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	m, err := c.Close(ctx, manifest.Manifest{Tool: "corruption-test"})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// streamCorpus is a captured single-shard stream and its frame layout.
type streamCorpus struct {
	files  map[string][]byte
	b      []byte
	frames []manifest.Frame
}

func newStreamCorpus(t testing.TB, spec string) *streamCorpus {
	ctx := context.Background()
	files := corpusFiles()
	var buf bytes.Buffer
	out, err := streamer.NewStreamOutput([]io.Writer{&buf})
	if err != nil {
		t.Fatal(err)
	}
	captureFiles(t, ctx, out, pipeline.Options{ChunkSize: corpusChunk, Workers: 2, Codec: pipelinetest.MustSpec(t, spec)}, files)
	sc := &streamCorpus{files: files, b: buf.Bytes()}
	rd, err := manifest.NewReader(bytes.NewReader(sc.b), "corpus")
	if err != nil {
		t.Fatal(err)
	}
	codecs := map[uint8]bool{}
	for {
		fr, err := rd.Next(nil)
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		fr.Payload = nil
		sc.frames = append(sc.frames, fr)
		if fr.Type == manifest.FrameData {
			codecs[fr.Codec] = true
		}
	}
	if spec == "auto" && (!codecs[uint8(codec.None)] || !codecs[uint8(codec.Zero)] || len(codecs) < 3) {
		t.Fatalf("corpus uses codecs %v; want raw, zero and a compressor", codecs)
	}
	return sc
}

// frameAt returns the frame holding byte off, or nil for the stream
// header and the tail.
func (sc *streamCorpus) frameAt(off int64) *manifest.Frame {
	for i := range sc.frames {
		f := &sc.frames[i]
		if off >= f.Pos && off < f.Pos+manifest.FrameSize+int64(f.StoredLen) {
			return f
		}
	}
	return nil
}

// positions samples the bytes to corrupt: all of the stream header and of
// every frame header, a few bytes inside every payload, all of the tail.
func (sc *streamCorpus) positions(headerStep int) []int64 {
	var out []int64
	for i := int64(0); i < manifest.HeaderSize; i++ {
		out = append(out, i)
	}
	for _, f := range sc.frames {
		for i := int64(0); i < manifest.FrameSize; i += int64(headerStep) {
			out = append(out, f.Pos+i)
		}
		if n := int64(f.StoredLen); n > 0 {
			p := f.Pos + manifest.FrameSize
			for _, k := range []int64{0, 1, n / 3, n / 2, n - 2, n - 1} {
				if k >= 0 && k < n {
					out = append(out, p+k)
				}
			}
		}
	}
	for i := int64(len(sc.b) - manifest.TailSize); i < int64(len(sc.b)); i++ {
		out = append(out, i)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return dedup(out)
}

func dedup(s []int64) []int64 {
	out := s[:0]
	for i, v := range s {
		if i == 0 || v != s[i-1] {
			out = append(out, v)
		}
	}
	return out
}

type copyResult struct {
	name string
	data []byte
	err  error
}

// serveDamaged runs a StreamSource over b, copying every file while the
// stream decodes, and returns Wait's error and the copies.
func serveDamaged(ctx context.Context, sc *streamCorpus, b []byte, so StreamSourceOptions) ([]copyResult, error) {
	src := NewStreamSource(ctx, []io.Reader{bytes.NewReader(b)}, []string{"damaged"}, so)
	defer src.Close()
	results := make(chan copyResult, len(sc.files))
	for name := range sc.files {
		go func() {
			var buf bytes.Buffer
			_, err := src.Copy(ctx, name, &buf)
			results <- copyResult{name, buf.Bytes(), err}
		}()
	}
	err := src.Wait(ctx)
	var out []copyResult
	for range sc.files {
		out = append(out, <-results)
	}
	return out, err
}

// checkNothingWrong fails if any served copy differs from the original.
func checkNothingWrong(t *testing.T, what string, sc *streamCorpus, copies []copyResult) {
	t.Helper()
	for _, c := range copies {
		if c.err == nil && !bytes.Equal(c.data, sc.files[c.name]) {
			t.Fatalf("%s: %s served with %d wrong bytes (want %d)", what, c.name, len(c.data), len(sc.files[c.name]))
		}
	}
}

// checkDirNothingWrong fails if an extracted file differs from the original.
func checkDirNothingWrong(t *testing.T, what, dir string, sc *streamCorpus) {
	t.Helper()
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		want, ok := sc.files[e.Name()]
		if !ok {
			t.Fatalf("%s: extract left %s behind", what, e.Name())
		}
		got, _ := os.ReadFile(filepath.Join(dir, e.Name()))
		if !bytes.Equal(got, want) {
			t.Fatalf("%s: extracted %s is wrong", what, e.Name())
		}
	}
}

func TestStreamCorruption(t *testing.T) {
	for _, spec := range []string{"auto", "lz4"} {
		t.Run(spec, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(5*time.Minute))
			defer cancel()
			sc := newStreamCorpus(t, spec)
			// The undamaged stream serves everything.
			copies, err := serveDamaged(ctx, sc, sc.b, StreamSourceOptions{Options: pipeline.Options{Workers: 2}, ServeEarly: true})
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range copies {
				if c.err != nil || !bytes.Equal(c.data, sc.files[c.name]) {
					t.Fatalf("undamaged stream: %s: %v", c.name, c.err)
				}
			}
			step := 1
			if raceEnabled || testing.Short() {
				step = 3
			}
			positions := sc.positions(step)
			// UnmarshalHeader checks the version before the checksum, on
			// purpose, so a damaged version field reads as "newer".
			var newer []string
			defer func() {
				if len(newer) > 0 {
					t.Logf("damaged version field reported as a newer version: %v", newer)
				}
			}()
			tailPos := int64(len(sc.b) - manifest.TailSize)
			for i, off := range positions {
				for _, mask := range []byte{0x01, 0x80} {
					b := bytes.Clone(sc.b)
					b[off] ^= mask
					what := fmt.Sprintf("byte %d ^ %02x", off, mask)
					so := StreamSourceOptions{Options: pipeline.Options{Workers: 2}, ServeEarly: true}
					extract := i%5 == 0 && mask == 1
					if extract {
						so.ExtractDir = t.TempDir()
						so.ServeEarly = false
					}
					copies, err := serveDamaged(ctx, sc, b, so)
					if err == nil {
						t.Fatalf("%s: stream served without an error", what)
					}
					if errors.Is(err, manifest.ErrNewerVersion) && off >= 8 && off < 10 {
						newer = append(newer, what)
					} else if !errors.Is(err, errdefs.ErrCorrupt) {
						t.Errorf("%s: error %q does not wrap errdefs.ErrCorrupt", what, err)
					}
					// The error names where the damage is.
					var wantAt int64
					switch f := sc.frameAt(off); {
					case off < manifest.HeaderSize:
						wantAt = 0
					case f != nil:
						wantAt = f.Pos
					default:
						wantAt = tailPos
					}
					if !strings.Contains(err.Error(), fmt.Sprintf("offset %d", wantAt)) {
						t.Errorf("%s: error %q does not name offset %d", what, err, wantAt)
					}
					checkNothingWrong(t, what, sc, copies)
					if extract {
						checkDirNothingWrong(t, what, so.ExtractDir, sc)
					}
				}
			}
		})
	}
}

func TestStreamTruncation(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(5*time.Minute))
	defer cancel()
	sc := newStreamCorpus(t, "auto")
	var cuts []int64
	step := int64(97)
	if raceEnabled {
		step = 997
	}
	for n := int64(0); n < int64(len(sc.b)); n += step {
		cuts = append(cuts, n)
	}
	for _, f := range sc.frames {
		for _, d := range []int64{-1, 0, 1, manifest.FrameSize - 1, manifest.FrameSize, manifest.FrameSize + 1} {
			if n := f.Pos + d; n >= 0 && n < int64(len(sc.b)) {
				cuts = append(cuts, n)
			}
		}
	}
	for d := int64(1); d <= manifest.TailSize; d++ {
		cuts = append(cuts, int64(len(sc.b))-d)
	}
	sort.Slice(cuts, func(i, j int) bool { return cuts[i] < cuts[j] })
	for i, n := range dedup(cuts) {
		what := fmt.Sprintf("cut at %d of %d", n, len(sc.b))
		so := StreamSourceOptions{Options: pipeline.Options{Workers: 2}, ServeEarly: i%2 == 0}
		if i%7 == 3 {
			so.ExtractDir = t.TempDir()
		}
		copies, err := serveDamaged(ctx, sc, sc.b[:n], so)
		if err == nil {
			t.Fatalf("%s: no error", what)
		}
		if n > 0 && !strings.Contains(err.Error(), "offset") {
			t.Errorf("%s: error %q names no offset", what, err)
		}
		checkNothingWrong(t, what, sc, copies)
		if so.ExtractDir != "" {
			checkDirNothingWrong(t, what, so.ExtractDir, sc)
		}
	}
}

// Shards of one stream must not be mixed with another stream's, reordered
// into a different count, or served when one is missing its END.
func TestStreamShardMismatch(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	capture3 := func() [][]byte {
		bufs := make([]*bytes.Buffer, 3)
		ws := make([]io.Writer, 3)
		for i := range bufs {
			bufs[i] = new(bytes.Buffer)
			ws[i] = bufs[i]
		}
		out, _ := streamer.NewStreamOutput(ws)
		captureFiles(t, ctx, out, pipeline.Options{ChunkSize: corpusChunk, Workers: 2, Codec: pipelinetest.MustSpec(t, "lz4")}, corpusFiles())
		var out3 [][]byte
		for _, b := range bufs {
			out3 = append(out3, b.Bytes())
		}
		return out3
	}
	a, b := capture3(), capture3()
	serve := func(shards ...[]byte) error {
		var rs []io.Reader
		var names []string
		for i, s := range shards {
			rs = append(rs, bytes.NewReader(s))
			names = append(names, fmt.Sprintf("shard %d", i))
		}
		src := NewStreamSource(ctx, rs, names, StreamSourceOptions{Options: pipeline.Options{Workers: 2}})
		defer src.Close()
		return src.Wait(ctx)
	}
	if err := serve(a...); err != nil {
		t.Fatalf("good shards: %v", err)
	}
	if err := serve(a[2], a[0], a[1]); err != nil {
		t.Fatalf("shards in another order: %v", err)
	}
	for _, tc := range []struct {
		name   string
		shards [][]byte
		want   string
	}{
		{"mixed streams", [][]byte{a[0], b[1], a[2]}, "another stream"},
		{"missing shard", [][]byte{a[0], a[1]}, "3 shards, 2 given"},
		{"shard twice", [][]byte{a[0], a[1], a[1]}, ""},
		{"shard truncated", [][]byte{a[0], a[1][:len(a[1])-100], a[2]}, "offset"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := serve(tc.shards...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// ---- archives ----

type archiveCorpus struct {
	files map[string][]byte
	store *mem.Store
	m     *manifest.Manifest
}

func newArchiveCorpus(t testing.TB, spec string) *archiveCorpus {
	ctx := context.Background()
	ac := &archiveCorpus{files: corpusFiles(), store: mem.New("corpus")}
	out, err := streamer.NewArchiveOutput(ctx, ac.store, 150<<10)
	if err != nil {
		t.Fatal(err)
	}
	ac.m = captureFiles(t, ctx, out, pipeline.Options{ChunkSize: corpusChunk, Workers: 2, Codec: pipelinetest.MustSpec(t, spec)}, ac.files)
	if len(ac.m.Segments) < 2 {
		t.Fatalf("corpus archive has %d segments, want several", len(ac.m.Segments))
	}
	return ac
}

// copyAll copies every file; it returns the errors by file name.
func copyAll(t *testing.T, ctx context.Context, a *ArchiveSource, files map[string][]byte) map[string]error {
	t.Helper()
	errs := map[string]error{}
	for name, want := range files {
		var buf bytes.Buffer
		_, err := a.Copy(ctx, name, &buf)
		if err != nil {
			errs[name] = err
			continue
		}
		if !bytes.Equal(buf.Bytes(), want) {
			t.Fatalf("%s served with wrong bytes", name)
		}
	}
	return errs
}

func TestArchiveCorruption(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(5*time.Minute))
	defer cancel()
	ac := newArchiveCorpus(t, "auto")
	a, err := OpenArchive(ctx, ac.store, pipeline.Options{Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	if errs := copyAll(t, ctx, a, ac.files); len(errs) > 0 {
		t.Fatalf("undamaged archive: %v", errs)
	}
	tested := 0
	for _, f := range ac.m.Files {
		for ci, c := range f.Chunks {
			if codec.ID(c.Codec) == codec.Zero {
				continue
			}
			seg := ac.m.Segments[c.Segment].Name
			obj := ac.store.Object(seg)
			for _, tc := range []struct {
				what string
				off  int64
				want string
			}{
				{"payload first byte", c.Pos + manifest.FrameSize, ""},
				{"payload middle", c.Pos + manifest.FrameSize + int64(c.Stored)/2, ""},
				{"payload last byte", c.Pos + manifest.FrameSize + int64(c.Stored) - 1, ""},
				{"frame header offset field", c.Pos + 9, "checksum mismatch"},
				{"frame header checksum", c.Pos + 62, "checksum mismatch"},
			} {
				what := fmt.Sprintf("%s chunk %d (%s), %s", f.Name, ci, codec.ID(c.Codec), tc.what)
				obj[tc.off] ^= 0x04
				errs := copyAll(t, ctx, a, ac.files)
				obj[tc.off] ^= 0x04
				err := errs[f.Name]
				if err == nil {
					t.Fatalf("%s: Copy succeeded", what)
				}
				if len(errs) != 1 {
					t.Fatalf("%s: other files failed too: %v", what, errs)
				}
				for _, w := range []string{seg, fmt.Sprintf("at offset %d", c.Pos), f.Name, tc.want} {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("%s: error %q does not name %q", what, err, w)
					}
				}
				if !errors.Is(err, errdefs.ErrCorrupt) {
					t.Errorf("%s: error %q does not wrap errdefs.ErrCorrupt", what, err)
				}
				tested++
			}
		}
	}
	if tested < 10 {
		t.Fatalf("only %d corruptions tested", tested)
	}
	// A copy after all that still works: no state is left behind.
	if errs := copyAll(t, ctx, a, ac.files); len(errs) > 0 {
		t.Fatalf("after the damage was repaired: %v", errs)
	}
}

// A segment cut short, or missing, fails the files that live in it, with
// the segment's name.
func TestArchiveMissingData(t *testing.T) {
	ctx := context.Background()
	ac := newArchiveCorpus(t, "lz4")
	a, err := OpenArchive(ctx, ac.store, pipeline.Options{Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	inSeg := func(seg int) map[string]bool {
		out := map[string]bool{}
		for _, f := range ac.m.Files {
			for _, c := range f.Chunks {
				if c.Segment == seg && codec.ID(c.Codec) != codec.Zero {
					out[f.Name] = true
				}
			}
		}
		return out
	}
	last := len(ac.m.Segments) - 1
	seg := ac.m.Segments[last].Name
	orig := bytes.Clone(ac.store.Object(seg))
	affected := inSeg(last)
	if len(affected) == 0 {
		t.Fatal("last segment holds no data")
	}
	for _, tc := range []struct {
		name  string
		apply func()
	}{
		{"truncated", func() { ac.store.Put(seg, orig[:len(orig)/2]) }},
		{"missing", func() { ac.store.Delete(context.Background(), seg) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.apply()
			defer func() { ac.store.Put(seg, orig) }()
			errs := copyAll(t, ctx, a, ac.files)
			for name := range ac.files {
				err := errs[name]
				switch {
				case affected[name] && err == nil:
					// The damage may lie past this file's chunks.
				case !affected[name] && err != nil:
					t.Fatalf("%s does not live in %s but failed: %v", name, seg, err)
				case err != nil && !strings.Contains(err.Error(), seg):
					t.Errorf("%s: error %q does not name segment %s", name, err, seg)
				}
			}
			if len(errs) == 0 {
				t.Fatal("no file failed")
			}
		})
	}
}

// manifest.json has no checksum of its own: a damaged one must at least
// never make the archive serve wrong bytes under an original name.
func TestArchiveManifestDamage(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(5*time.Minute))
	defer cancel()
	ac := newArchiveCorpus(t, "auto")
	orig := bytes.Clone(ac.store.Object(manifest.ManifestName))
	step := 7
	if raceEnabled {
		step = 29
	}
	var unnoticed, outside []string
	for off := 0; off < len(orig); off += step {
		b := bytes.Clone(orig)
		b[off] ^= 0x01
		ac.store.Put(manifest.ManifestName, b)
		a, err := OpenArchive(ctx, ac.store, pipeline.Options{Workers: 2})
		if err != nil {
			continue
		}
		if bad := chunkOutsideSegments(a.Manifest()); bad != "" {
			outside = append(outside, fmt.Sprintf("byte %d (%q): %s", off, orig[max(0, off-10):min(len(orig), off+10)], bad))
			continue // Copy would panic (index out of range) in a worker goroutine
		}
		files, _ := a.Files(ctx)
		listed := map[string]manifest.File{}
		for _, f := range files {
			listed[f.Name] = f
		}
		for name, want := range ac.files {
			if _, ok := listed[name]; !ok {
				unnoticed = append(unnoticed, fmt.Sprintf("byte %d (%q): %s no longer listed", off, orig[max(0, off-10):min(len(orig), off+10)], name))
				continue
			}
			var buf bytes.Buffer
			if _, err := a.Copy(ctx, name, &buf); err == nil && !bytes.Equal(buf.Bytes(), want) {
				t.Fatalf("byte %d of the manifest flipped: %s served with wrong bytes", off, name)
			}
		}
	}
	ac.store.Put(manifest.ManifestName, orig)
	if len(outside) > 0 {
		t.Logf("%d damaged manifests accepted with chunks outside the segment list, e.g. %s", len(outside), outside[0])
	}
	if len(unnoticed) > 0 {
		t.Logf("%d damaged manifests accepted with files renamed, e.g. %s", len(unnoticed), unnoticed[0])
	}
	if len(outside) > 0 {
		t.Errorf("%d damaged manifests name segments that do not exist", len(outside))
	}
	if len(unnoticed) > 0 {
		t.Errorf("%d damaged manifests accepted with files renamed, e.g. %s", len(unnoticed), unnoticed[0])
	}
}

// chunkOutsideSegments names a chunk whose segment index m.Segments lacks.
func chunkOutsideSegments(m *manifest.Manifest) string {
	for _, f := range m.Files {
		for i, c := range f.Chunks {
			if c.Segment < 0 || c.Segment >= len(m.Segments) {
				return fmt.Sprintf("%s chunk %d in segment %d of %d", f.Name, i, c.Segment, len(m.Segments))
			}
		}
	}
	return ""
}

// An archive manifest without segments but with chunks must be refused at
// open, not crash a copy.
func TestArchiveManifestWithoutSegments(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		files map[string][]byte
	}{
		{"data chunks", corpusFiles()},
		{"only zero chunks", map[string][]byte{"zeros.img": make([]byte, 3*corpusChunk), "empty.img": {}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store := mem.New(tc.name)
			out, err := streamer.NewArchiveOutput(ctx, store, 0)
			if err != nil {
				t.Fatal(err)
			}
			captureFiles(t, ctx, out, pipeline.Options{ChunkSize: corpusChunk, Workers: 2, Codec: pipelinetest.MustSpec(t, "lz4")}, tc.files)
			doc := store.Object(manifest.ManifestName)
			damaged := bytes.Replace(doc, []byte(`"segments"`), []byte(`"segmentz"`), 1)
			if bytes.Equal(doc, damaged) {
				t.Fatal("no segments key in the manifest")
			}
			store.Put(manifest.ManifestName, damaged)
			a, err := OpenArchive(ctx, store, pipeline.Options{Workers: 2})
			if err != nil {
				return // refused: good
			}
			if bad := chunkOutsideSegments(a.Manifest()); bad != "" {
				t.Fatalf("OpenArchive accepted a manifest whose chunks name segments it does not list (%s)", bad)
			}
			for name, want := range tc.files {
				var buf bytes.Buffer
				if _, err := a.Copy(ctx, name, &buf); err == nil && !bytes.Equal(buf.Bytes(), want) {
					t.Fatalf("%s served with wrong bytes", name)
				}
			}
		})
	}
}
