package source

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/streamer"
	"golang.org/x/sys/unix"
)

// hostile builds a stream frame by frame with the project's own writer:
// what a peer that does not play by the rules can send.
type hostile struct {
	t   testing.TB
	buf bytes.Buffer
	w   *manifest.Writer
}

func newHostile(t testing.TB) *hostile {
	h := &hostile{t: t}
	w, err := manifest.NewWriter(&h.buf, manifest.Header{ShardCount: 1, StreamID: 7})
	if err != nil {
		t.Fatal(err)
	}
	h.w = w
	return h
}

func (h *hostile) frame(fh manifest.FrameHeader, payload []byte) {
	h.t.Helper()
	if _, err := h.w.WriteFrame(&fh, payload); err != nil {
		h.t.Fatal(err)
	}
}

func (h *hostile) file(id uint32, name string) {
	h.frame(manifest.FrameHeader{Type: manifest.FrameFile, FileID: id}, []byte(name))
}

// data sends raw as one chunk encoded as spec says ("none", "lz4",
// "zstd"); all-zero raw becomes a zero chunk. It returns the chunk's hash.
func (h *hostile) data(id uint32, off uint64, spec string, raw []byte) [32]byte {
	h.t.Helper()
	enc, err := codec.NewEncoder(pipelinetest.MustSpec(h.t, spec))
	if err != nil {
		h.t.Fatal(err)
	}
	c, payload, err := enc.Encode(make([]byte, 0, enc.MaxEncodedLen(len(raw))), raw)
	if err != nil {
		h.t.Fatal(err)
	}
	hash := codec.ContentHash(raw)
	h.frame(manifest.FrameHeader{Type: manifest.FrameData, FileID: id, Offset: off, RawLen: uint32(len(raw)), Codec: uint8(c),
		Checksum: codec.Checksum(raw), Hash: hash}, payload)
	return hash
}

func (h *hostile) fileEnd(id uint32, size uint64, chunkHashes [][32]byte) {
	var hs []byte
	for _, c := range chunkHashes {
		hs = append(hs, c[:]...)
	}
	h.frame(manifest.FrameHeader{Type: manifest.FrameFileEnd, FileID: id, Offset: size, RawLen: uint32(len(chunkHashes)), Hash: pipeline.FileDigest(hs, int64(size))}, nil)
}

func (h *hostile) bytes() []byte {
	h.t.Helper()
	if err := h.w.Finish(nil); err != nil {
		h.t.Fatal(err)
	}
	return h.buf.Bytes()
}

// inspect of a stream refuses the names extract refuses, and never prints
// a name's control characters.
func TestScanStreamUnsafeNames(t *testing.T) {
	for _, name := range []string{"../../x", "/tmp/x", "x/y", ".", "..", "a\x00b"} {
		h := newHostile(t)
		h.file(0, name)
		h.fileEnd(0, 0, nil)
		_, err := ScanStream(bytes.NewReader(h.bytes()), "stdin")
		if !errors.Is(err, errdefs.ErrCorrupt) {
			t.Errorf("name %q: %v, want ErrCorrupt", name, err)
		}
		if err != nil && strings.ContainsRune(err.Error(), 0) {
			t.Errorf("name %q: error carries a NUL", name)
		}
	}
}

// Names with escape sequences reach errors quoted.
func TestStreamErrorEscapesNames(t *testing.T) {
	h := newHostile(t)
	h.file(0, "x\x1b]0;pwned\x07.img")
	h.data(0, 0, "none", []byte("abc"))
	b := h.bytes() // the file never ends
	s := NewStreamSource(context.Background(), []io.Reader{bytes.NewReader(b)}, []string{"stdin"}, StreamSourceOptions{Discard: true})
	defer s.Close()
	err := s.Wait(context.Background())
	if err == nil {
		t.Fatal("a file that never ends was accepted")
	}
	if strings.ContainsAny(err.Error(), "\x1b\x07") {
		t.Fatalf("error carries control characters: %q", err)
	}
}

// Stream extract never follows a symlink planted in the target directory,
// under a temporary name or the final one.
func TestStreamExtractPlantedSymlink(t *testing.T) {
	dir := t.TempDir()
	victim := filepath.Join(t.TempDir(), "victim.txt")
	if err := os.WriteFile(victim, []byte("precious"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{".a.img.partial-0", ".a.img.partial", ".a.img.partial-0-0", "b.img"} {
		if err := os.Symlink(victim, filepath.Join(dir, n)); err != nil {
			t.Fatal(err)
		}
	}
	h := newHostile(t)
	h.file(0, "a.img")
	h.fileEnd(0, 9, [][32]byte{h.data(0, 0, "none", []byte("attacker!"))})
	h.file(1, "b.img")
	h.fileEnd(1, 3, [][32]byte{h.data(1, 0, "none", []byte("bbb"))})
	s := NewStreamSource(context.Background(), []io.Reader{bytes.NewReader(h.bytes())}, []string{"stdin"}, StreamSourceOptions{ExtractDir: dir})
	if err := s.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	s.Close()
	if b, _ := os.ReadFile(victim); string(b) != "precious" {
		t.Fatalf("victim overwritten: %q", b)
	}
	for name, want := range map[string]string{"a.img": "attacker!", "b.img": "bbb"} {
		fi, err := os.Lstat(filepath.Join(dir, name))
		if err != nil || !fi.Mode().IsRegular() {
			t.Fatalf("%s: %v, mode %v: want a regular file", name, err, fi.Mode())
		}
		if b, _ := os.ReadFile(filepath.Join(dir, name)); string(b) != want {
			t.Errorf("%s holds %q", name, b)
		}
	}
}

// A failed stream extract leaves none of the files it finished.
func TestStreamExtractFailureLeavesNothing(t *testing.T) {
	dir := t.TempDir()
	h := newHostile(t)
	h.file(0, "a.img")
	h.fileEnd(0, 3, [][32]byte{h.data(0, 0, "none", []byte("aaa"))})
	h.file(1, "b.img")
	raw := []byte("bbb")
	h.frame(manifest.FrameHeader{Type: manifest.FrameData, FileID: 1, RawLen: 3, Checksum: codec.Checksum(raw) ^ 1, Hash: codec.ContentHash(raw)}, raw)
	s := NewStreamSource(context.Background(), []io.Reader{bytes.NewReader(h.bytes())}, []string{"stdin"}, StreamSourceOptions{ExtractDir: dir})
	err := s.Wait(context.Background())
	s.Close()
	if !errors.Is(err, errdefs.ErrCorrupt) {
		t.Fatalf("damaged stream: %v, want ErrCorrupt", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("failed extract left %d entries, first %s", len(ents), ents[0].Name())
	}
}

func rewriteManifest(t testing.TB, st store.Store, m *manifest.Manifest) {
	t.Helper()
	ctx := context.Background()
	b, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	w, err := st.Create(ctx, manifest.ManifestName)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(b); err != nil {
		t.Fatal(err)
	}
	if err := w.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

// A manifest whose chunk_size lies (chunks larger than it) is refused:
// the read-ahead budget counts chunks, and 64 MiB chunks in an archive
// declaring chunk_size 1 held 3.4 GB under --memory-limit 256MiB.
func TestArchiveLyingChunkSize(t *testing.T) {
	ctx := context.Background()
	ac := newArchiveCorpus(t, "lz4")
	const limit = 1 << 20
	// The honest archive: what the budget lets be held, counted by the
	// chunks' actual sizes, stays within the limit.
	a, err := OpenArchive(ctx, ac.store, pipeline.Options{MemoryLimit: limit, Workers: 16})
	if err != nil {
		t.Fatal(err)
	}
	var most int64
	for _, f := range ac.m.Files {
		for _, c := range f.Chunks {
			most = max(most, int64(c.RawLen)+int64(c.Stored)+manifest.FrameSize)
		}
	}
	if held := int64(cap(a.tokens)) * most; held > limit {
		t.Errorf("budget of %d chunks of up to %d bytes holds %d, over the limit of %d", cap(a.tokens), most, held, limit)
	}
	a.Close()
	for _, size := range []int{1, corpusChunk / 2} {
		m := *ac.m
		m.ChunkSize = size
		rewriteManifest(t, ac.store, &m)
		if a, err := OpenArchive(ctx, ac.store, pipeline.Options{MemoryLimit: limit, Workers: 16}); !errors.Is(err, errdefs.ErrCorrupt) {
			if err == nil {
				a.Close()
			}
			t.Errorf("chunk_size %d with chunks of %d: %v, want ErrCorrupt", size, corpusChunk, err)
		}
	}
}

// buffered is what the stream source holds in memory by its own count.
func (s *StreamSource) buffered() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.memUsed + s.metaUsed
}

// Stream metadata counts against the budget: zero chunks of a file that
// never ends, or FILE frames with long names, are refused once they would
// hold more than the memory limit, naming it.
func TestStreamMetadataBudget(t *testing.T) {
	const limit = 1 << 20
	zeros := func() []byte {
		h := newHostile(t)
		h.file(0, "pages-1.img")
		raw := make([]byte, 4096)
		for i := range 20000 { // 20000 chunk records, never ended
			h.data(0, uint64(i)*4096, "zstd", raw)
		}
		return h.bytes()
	}
	names := func() []byte {
		h := newHostile(t)
		for i := range 300 { // 300 names of 4000 bytes
			h.file(uint32(i), fmt.Sprintf("%04d%s", i, strings.Repeat("n", 3996)))
		}
		return h.bytes()
	}
	for _, tc := range []struct {
		name string
		b    []byte
		so   StreamSourceOptions
	}{
		{"zero chunks, verify", zeros(), StreamSourceOptions{Discard: true}},
		{"zero chunks, held", zeros(), StreamSourceOptions{}},
		{"names, verify", names(), StreamSourceOptions{Discard: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.so.MemoryLimit = limit
			tc.so.Workers = 2
			s := NewStreamSource(context.Background(), []io.Reader{bytes.NewReader(tc.b)}, []string{"stdin"}, tc.so)
			defer s.Close()
			err := s.Wait(context.Background())
			if !errors.Is(err, ErrMemoryLimit) || !strings.Contains(err.Error(), "--memory-limit") {
				t.Fatalf("%v, want ErrMemoryLimit naming --memory-limit", err)
			}
			if b := s.buffered(); b > limit+fileMeta+2*4000 {
				t.Fatalf("holds %d bytes, over the limit of %d", b, limit)
			}
		})
	}
	// inspect's index of a stream is bounded the same way.
	h := newHostile(t)
	h.file(0, "pages-1.img")
	for i := range maxScanChunks + 1 {
		h.frame(manifest.FrameHeader{Type: manifest.FrameData, FileID: 0, Offset: uint64(i) * 4096, RawLen: 4096, Codec: uint8(codec.Zero)}, nil)
	}
	if _, err := ScanStream(bytes.NewReader(h.bytes()), "stdin"); !errors.Is(err, ErrMemoryLimit) {
		t.Fatalf("ScanStream of %d chunks: %v, want ErrMemoryLimit", maxScanChunks+1, err)
	}
}

// A stream of well-compressed chunks declares far more than it carries: a
// receiver that spills (or an extract that writes) refuses to fill its
// file system instead of writing it all.
func TestStreamSpillBoundedBySpace(t *testing.T) {
	const free, total = 16 << 20, 100 << 20
	old := spaceLeft
	// What was written so far fills a small file system.
	spaceLeft = func(f *os.File) (int64, int64, error) {
		fi, err := f.Stat()
		if err != nil {
			return 0, 0, err
		}
		return free - fi.Size(), total, nil
	}
	t.Cleanup(func() { spaceLeft = old })
	for _, so := range []StreamSourceOptions{{SpillDir: t.TempDir()}, {ExtractDir: t.TempDir()}} {
		h := newHostile(t)
		h.file(0, "pages-1.img")
		raw := bytes.Repeat([]byte{1}, 1<<20)
		for i := range 64 { // 64 MiB declared in a few KiB
			h.data(0, uint64(i)<<20, "zstd", raw)
		}
		b := h.bytes()
		if len(b) > 1<<20 {
			t.Fatalf("hostile stream of %d bytes", len(b))
		}
		so.MemoryLimit, so.Workers = 1<<20, 1
		s := NewStreamSource(context.Background(), []io.Reader{bytes.NewReader(b)}, []string{"stdin"}, so)
		err := s.Wait(context.Background())
		s.Close()
		if !errors.Is(err, ErrNoSpace) {
			t.Fatalf("%+v: %v, want ErrNoSpace", so, err)
		}
	}
}

// Declared zero chunks are holes in an extracted file, not written bytes:
// a 20 KB archive filled a 100 MB tmpfs.
func TestArchiveExtractZerosSparse(t *testing.T) {
	ctx := context.Background()
	st := mem.New("zeros")
	out, err := streamer.NewArchiveOutput(ctx, st, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	const size = 64 << 20
	data := make([]byte, size)
	copy(data[size/2:], "not all zeros")
	captureFiles(t, ctx, out, pipeline.Options{ChunkSize: 1 << 20, Workers: 2, Codec: pipelinetest.MustSpec(t, "lz4")}, map[string][]byte{"pages-1.img": data})
	a, err := OpenArchive(ctx, st, pipeline.Options{VerifyHashes: true})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	f, err := os.Create(filepath.Join(t.TempDir(), "pages-1.img"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := a.Copy(ctx, "pages-1.img", f); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(f.Name())
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("extracted file differs (%v)", err)
	}
	var st2 unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st2); err != nil {
		t.Fatal(err)
	}
	if used := st2.Blocks * 512; used > size/8 {
		t.Fatalf("%d zero bytes take %d bytes on disk: not sparse", size, used)
	}
}

// A segment size of -2^63 wrapped Validate's bound check; the archive is
// refused when it is opened, not later by verify.
func TestArchiveNegativeSegmentSize(t *testing.T) {
	ac := newArchiveCorpus(t, "lz4")
	m := *ac.m
	m.Segments = append([]manifest.Segment(nil), m.Segments...)
	m.Segments[0].Size = math.MinInt64
	rewriteManifest(t, ac.store, &m)
	if a, err := OpenArchive(context.Background(), ac.store, pipeline.Options{}); !errors.Is(err, errdefs.ErrCorrupt) {
		if err == nil {
			a.Close()
		}
		t.Fatalf("segment of size -2^63: %v, want ErrCorrupt", err)
	}
}
