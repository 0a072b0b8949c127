package streamer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/testwait"
)

// hookStore wraps a store and asks write, when set, before every Write to
// an object with the object's name, the bytes and the offset they go to.
type hookStore struct {
	store.Store
	write func(name string, p []byte, off int64) error
}

func (s *hookStore) Create(ctx context.Context, name string) (store.ObjectWriter, error) {
	w, err := s.Store.Create(ctx, name)
	if err != nil {
		return nil, err
	}
	return &hookWriter{ObjectWriter: w, s: s, name: name}, nil
}

type hookWriter struct {
	store.ObjectWriter
	s    *hookStore
	name string
	off  int64
}

func (w *hookWriter) Write(p []byte) (int, error) {
	if w.s.write != nil {
		if err := w.s.write(w.name, p, w.off); err != nil {
			return 0, err
		}
	}
	n, err := w.ObjectWriter.Write(p)
	w.off += int64(n)
	return n, err
}

// isSegment says whether name is segment i of some capture.
func isSegment(name string, i int) bool {
	return manifest.IsSegmentName(name) && strings.HasSuffix(name, fmt.Sprintf("-%08d.gcs", i))
}

// storeObjects reads every object of st.
func storeObjects(t *testing.T, st store.Store) map[string][]byte {
	t.Helper()
	ctx := context.Background()
	list, err := st.List(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]byte{}
	for _, o := range list {
		r, err := st.Open(ctx, o.Name, 0, -1)
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(r)
		r.Close()
		if err != nil {
			t.Fatal(err)
		}
		out[o.Name] = b
	}
	return out
}

// lanesCorpus has chunks above and below minLanePayload, zero chunks, a
// file larger than several segments, and files that stay open across
// segments.
func lanesCorpus() map[string][]byte {
	return map[string][]byte{
		"pages-1.img": pipelinetest.MixedData(3<<20+12345, 1),
		"pages-2.img": pipelinetest.MixedData(2<<20+999, 5),
		"zeros.img":   make([]byte, 700<<10),
		"small.img":   pipelinetest.SmallData(1000, 2),
		"ext-0":       pipelinetest.SmallData(200<<10, 3),
		"empty.img":   {},
		"tail.img":    pipelinetest.MixedData(300<<10+7, 4),
	}
}

type segFrame struct {
	file string
	off  uint64
}

// scanSegment decodes one segment object on its own, as a stream: the
// reader refuses a DATA or FILE-END frame of a file without a FILE frame
// before it in the segment, a missing END frame or tail, and (with seal)
// an END tag that does not authenticate the segment. It returns the
// segment's DATA frames by position.
func scanSegment(t *testing.T, b []byte, name string, seal *crypt.Session) map[int64]segFrame {
	t.Helper()
	rd, err := manifest.NewReader(bytes.NewReader(b), name)
	if err != nil {
		t.Fatalf("segment %s: %v", name, err)
	}
	if seal != nil {
		pipeline.CheckEnd(rd, seal)
	}
	data := map[int64]segFrame{}
	for {
		fr, err := rd.Next(nil)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("segment %s does not decode on its own: %v", name, err)
		}
		if fr.Type == manifest.FrameData {
			data[fr.Pos] = segFrame{rd.FileName(fr.FileID), fr.Offset}
		}
	}
	if rd.Pos() != int64(len(b)) {
		t.Fatalf("segment %s: %d bytes after its tail", name, int64(len(b))-rd.Pos())
	}
	return data
}

// An archive written on several lanes, by several producers at once, reads
// back identical with hash verification, plain and encrypted, every codec,
// in memory and in a directory; its segments are numbered without gaps,
// each decodes on its own, and every chunk is where the manifest says.
func TestArchiveLanesReadBack(t *testing.T) {
	files := lanesCorpus()
	k := pipelinetest.Key(t, 7)
	stores := map[string]func(t *testing.T) store.Store{
		"mem": func(t *testing.T) store.Store { return mem.New(t.Name()) },
		"dir": func(t *testing.T) store.Store { return dir.New(t.TempDir()) },
	}
	for _, tc := range []struct {
		store, spec string
		sealed      bool
		lanes       int
	}{
		{"mem", "none", false, 4},
		{"mem", "lz4", false, 4},
		{"mem", "zstd", false, 3},
		{"mem", "none", true, 4},
		{"mem", "zstd", true, 2},
		{"mem", "none", false, 1},
		{"mem", "lz4", true, 1},
		{"dir", "none", false, 4},
		{"dir", "lz4", true, 4},
	} {
		name := fmt.Sprintf("%s/%s/sealed=%v/lanes=%d", tc.store, tc.spec, tc.sealed, tc.lanes)
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
			defer cancel()
			base := pipelinetest.CountGoroutines()
			var seal *crypt.Session
			if tc.sealed {
				seal = pipelinetest.Session(t, k)
			}
			st := stores[tc.store](t)
			out, err := NewArchiveOutputAs(ctx, st, 512<<10, pipeline.Format{Seal: seal})
			if err != nil {
				t.Fatal(err)
			}
			out.SetLanes(tc.lanes)
			c, err := NewCapture(ctx, out, pipeline.Options{ChunkSize: 256 << 10, Workers: 3, Codec: pipelinetest.MustSpec(t, tc.spec)})
			if err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			errs := make(chan error, len(files))
			i := 0
			for name, b := range files {
				wg.Add(1)
				go func(name string, r io.Reader) {
					defer wg.Done()
					if _, err := c.WriteFile(name, r, strings.HasPrefix(name, "ext-")); err != nil {
						errs <- err
					}
				}(name, pipelinetest.Reader(b, i))
				i++
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			m, err := c.Close(ctx, manifest.Manifest{ID: "lanes", Host: "h"})
			if err != nil {
				t.Fatal(err)
			}
			if len(m.Segments) < 2*tc.lanes {
				t.Fatalf("%d segments: the corpus should span several per lane", len(m.Segments))
			}
			objs := storeObjects(t, st)
			if len(objs) != len(m.Segments)+1 {
				t.Fatalf("store holds %d objects for %d segments and the manifest", len(objs), len(m.Segments))
			}
			frames := map[int]map[int64]segFrame{}
			for i, s := range m.Segments {
				if s.Name != manifest.SegmentName(out.streamID, i) {
					t.Fatalf("segment %d named %s, want %s", i, s.Name, manifest.SegmentName(out.streamID, i))
				}
				b, ok := objs[s.Name]
				if !ok || int64(len(b)) != s.Size {
					t.Fatalf("segment %s: %d bytes stored (present %v), manifest says %d", s.Name, len(b), ok, s.Size)
				}
				frames[i] = scanSegment(t, b, s.Name, seal)
			}
			// Every chunk is a DATA frame of its file at its offset, where
			// the manifest says; with several lanes a file's chunks go back
			// and forth between segments open at once.
			back := false
			for _, f := range m.Files {
				last := -1
				for _, ch := range f.Chunks {
					if codec.ID(ch.Codec) == codec.Zero {
						continue
					}
					if got := frames[ch.Segment][ch.Pos]; got != (segFrame{f.Name, uint64(ch.Offset)}) {
						t.Fatalf("%s chunk at %d: segment %d at %d holds %+v", f.Name, ch.Offset, ch.Segment, ch.Pos, got)
					}
					back = back || ch.Segment < last
					last = ch.Segment
				}
			}
			if back != (tc.lanes > 1) {
				t.Fatalf("%d lanes: a file's chunks go back to an earlier segment: %v", tc.lanes, back)
			}
			src, err := source.OpenArchive(ctx, st, pipeline.Options{Key: keyIf(seal, k), VerifyHashes: true})
			if err != nil {
				t.Fatal(err)
			}
			pipelinetest.CheckSource(t, ctx, name, src, files)
			if rep, err := source.VerifyArchive(ctx, src); err != nil || rep.Files != len(files) {
				t.Fatalf("source.VerifyArchive = %+v, %v; want %d files", rep, err, len(files))
			}
			src.Close()
			pipelinetest.WaitGoroutines(t, base)
		})
	}
}

func keyIf(s *crypt.Session, k *crypt.Key) *crypt.Key {
	if s == nil {
		return nil
	}
	return k
}

// A write that fails in one lane fails the capture with the segment's
// name; nothing is committed, no manifest is written, and every lane
// ends.
func TestArchiveLaneWriteFails(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	for _, kind := range []string{"mem", "dir"} {
		t.Run(kind, func(t *testing.T) {
			base := pipelinetest.CountGoroutines()
			st := &hookStore{Store: mem.New(t.Name())}
			if kind == "dir" {
				st.Store = dir.New(t.TempDir())
			}
			var failed atomic.Int32
			st.write = func(name string, p []byte, off int64) error {
				if isSegment(name, 1) && off > 300<<10 {
					failed.Add(1)
					return errBoom
				}
				return nil
			}
			out, err := NewArchiveOutput(ctx, st, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			out.SetLanes(4)
			c, err := NewCapture(ctx, out, pipeline.Options{ChunkSize: 128 << 10, Workers: 2, Codec: pipelinetest.MustSpec(t, "none")})
			if err != nil {
				t.Fatal(err)
			}
			_, werr := c.WriteFile("pages-1.img", &patternReader{n: 6 << 20}, false)
			_, cerr := c.Close(ctx, manifest.Manifest{})
			bad := manifest.SegmentName(out.streamID, 1)
			if failed.Load() == 0 {
				t.Fatalf("segment %s was never written past 300 KiB", bad)
			}
			if !errors.Is(cerr, errBoom) || !strings.Contains(cerr.Error(), bad) {
				t.Fatalf("Close = %v, want %v naming %s (WriteFile: %v)", cerr, errBoom, bad, werr)
			}
			if werr != nil && !errors.Is(werr, errBoom) {
				t.Fatalf("WriteFile = %v", werr)
			}
			if objs := storeObjects(t, st); len(objs) != 0 {
				t.Fatalf("store keeps %d objects after a failed write", len(objs))
			}
			if _, err := source.ReadManifest(ctx, st); err == nil {
				t.Fatal("a manifest was written")
			}
			pipelinetest.WaitGoroutines(t, base)
		})
	}
}

// Abort waits for the lanes' writes in flight before it removes the
// segments, and every payload is handed back before it returns.
func TestArchiveAbortWaitsForLanes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	base := pipelinetest.CountGoroutines()
	gate := make(chan struct{})
	blocked := make(chan struct{}, 3)
	st := &hookStore{Store: mem.New(t.Name())}
	st.write = func(name string, p []byte, off int64) error {
		if len(p) >= minLanePayload {
			blocked <- struct{}{}
			<-gate
		}
		return nil
	}
	out, err := NewArchiveOutput(ctx, st, 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	out.SetLanes(2)
	fh := manifest.FrameHeader{Type: manifest.FrameFile, FileID: 1}
	if _, err := out.WriteFrame(ctx, &fh, []byte("vram.bin")); err != nil {
		t.Fatal(err)
	}
	var handed atomic.Int32
	segs := map[int]bool{}
	for i := range 3 {
		fh := manifest.FrameHeader{Type: manifest.FrameData, FileID: 1, Offset: uint64(i) << 20, RawLen: 1 << 20}
		loc, err := out.WriteFrameAsync(ctx, &fh, make([]byte, 1<<20), func(err error) {
			handed.Add(1)
		})
		if err != nil {
			t.Fatal(err)
		}
		segs[loc.Segment] = true
	}
	if len(segs) != 2 {
		t.Fatalf("3 payloads on 2 lanes went to segments %v", segs)
	}
	// Both lanes are in a write; the third payload waits in a queue.
	<-blocked
	<-blocked
	aborted := make(chan error, 1)
	go func() { aborted <- out.Abort(ctx) }()
	select {
	case err := <-aborted:
		t.Fatalf("Abort returned (%v) with writes in flight", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(gate)
	if err := <-aborted; err != nil {
		t.Fatal(err)
	}
	if n := handed.Load(); n != 3 {
		t.Fatalf("%d of 3 payloads handed back when Abort returned", n)
	}
	if names := st.Store.(*mem.Store).Names(); len(names) != 0 {
		t.Fatalf("store keeps %v after Abort", names)
	}
	if _, err := out.WriteFrame(ctx, &fh, nil); err == nil {
		t.Fatal("WriteFrame after Abort succeeded")
	}
	pipelinetest.WaitGoroutines(t, base)
}

// A lane finishes a segment only after the frames queued before its end;
// a sync WriteFrame of a large payload returns once it is written.
func TestArchiveLanesWriteFrame(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	st := mem.New(t.Name())
	out, err := NewArchiveOutput(ctx, st, 256<<10)
	if err != nil {
		t.Fatal(err)
	}
	out.SetLanes(3)
	fh := manifest.FrameHeader{Type: manifest.FrameFile, FileID: 9}
	if _, err := out.WriteFrame(ctx, &fh, []byte("f")); err != nil {
		t.Fatal(err)
	}
	m := manifest.Manifest{ID: "x", Files: []manifest.File{{Name: "f", Chunks: []manifest.Chunk{}}}}
	var size int64
	for i := range 10 {
		p := pipelinetest.MixedData(100<<10+i, uint64(i))
		fh := manifest.FrameHeader{Type: manifest.FrameData, FileID: 9, Offset: uint64(size), RawLen: uint32(len(p)), Checksum: codec.Checksum(p)}
		loc, err := out.WriteFrame(ctx, &fh, p)
		if err != nil {
			t.Fatal(err)
		}
		p[0] ^= 0xff // the frame is written: the buffer is the caller's again
		m.Files[0].Chunks = append(m.Files[0].Chunks, manifest.Chunk{Offset: size, RawLen: fh.RawLen, Stored: fh.RawLen, Checksum: fh.Checksum, Segment: loc.Segment, Pos: loc.Pos})
		size += int64(len(p))
	}
	fh = manifest.FrameHeader{Type: manifest.FrameFileEnd, FileID: 9, Offset: uint64(size)}
	if _, err := out.WriteFrame(ctx, &fh, nil); err != nil {
		t.Fatal(err)
	}
	m.Files[0].Size = size
	if err := out.Commit(ctx, &m); err != nil {
		t.Fatal(err)
	}
	for i, s := range m.Segments {
		b := st.Object(s.Name)
		if b == nil || int64(len(b)) != s.Size {
			t.Fatalf("segment %d: %d bytes stored, manifest says %d", i, len(b), s.Size)
		}
		frames := scanSegment(t, b, s.Name, nil)
		for _, ch := range m.Files[0].Chunks {
			if ch.Segment == i && frames[ch.Pos] != (segFrame{"f", uint64(ch.Offset)}) {
				t.Fatalf("chunk at %d: segment %d at %d holds %+v", ch.Offset, i, ch.Pos, frames[ch.Pos])
			}
		}
	}
	if len(m.Segments) < 4 {
		t.Fatalf("%d segments for 1 MiB in segments of 256 KiB", len(m.Segments))
	}
}
