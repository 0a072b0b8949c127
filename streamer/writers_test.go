package streamer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/mem"
)

// atStore wraps a store whose writers write at offsets: it counts the
// payload writes (WriteAt of minAsyncPayload bytes or more) and asks fail,
// when set, before each WriteAt.
type atStore struct {
	store.Store
	payloads atomic.Int64
	fail     func(name string, p []byte, off int64) error
}

func (s *atStore) Create(ctx context.Context, name string) (store.ObjectWriter, error) {
	w, err := s.Store.Create(ctx, name)
	if err != nil {
		return nil, err
	}
	return &atWriter{WriterAt: w.(store.WriterAt), s: s, name: name}, nil
}

type atWriter struct {
	store.WriterAt
	s    *atStore
	name string
}

func (w *atWriter) WriteAt(p []byte, off int64) (int, error) {
	if len(p) >= minAsyncPayload {
		w.s.payloads.Add(1)
	}
	if w.s.fail != nil {
		if err := w.s.fail(w.name, p, off); err != nil {
			return 0, err
		}
	}
	return w.WriterAt.WriteAt(p, off)
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

// writersCorpus has chunks above and below minAsyncPayload, zero chunks,
// a file larger than several segments, and files that stay open across
// segments.
func writersCorpus() (names []string, files map[string][]byte) {
	files = map[string][]byte{
		"pages-1.img": mixedData(3<<20+12345, 1),
		"zeros.img":   make([]byte, 700<<10),
		"small.img":   smallData(1000, 2),
		"ext-0":       smallData(200<<10, 3),
		"empty.img":   {},
		"tail.img":    mixedData(300<<10+7, 4),
	}
	return []string{"small.img", "pages-1.img", "empty.img", "zeros.img", "ext-0", "tail.img"}, files
}

// TestArchiveWritersSameBytes: an archive written with several payload
// writers is byte for byte the one written with one, plain and encrypted,
// in memory and in a directory, and reads back.
func TestArchiveWritersSameBytes(t *testing.T) {
	names, files := writersCorpus()
	k := testKey(t, 7)
	session := testSession(t, k) // shared: same stream id, salt, nonces
	stores := map[string]func(t *testing.T) store.Store{
		"mem": func(t *testing.T) store.Store { return mem.New(t.Name()) },
		"dir": func(t *testing.T) store.Store { return dir.New(t.TempDir()) },
	}
	for _, tc := range []struct {
		store, spec string
		seal        *crypt.Session
	}{
		{"mem", "none", nil},
		{"mem", "zstd", nil},
		{"mem", "none", session},
		{"mem", "lz4", session},
		{"dir", "none", nil},
		{"dir", "none", session},
	} {
		sealed := "plain"
		if tc.seal != nil {
			sealed = "sealed"
		}
		t.Run(tc.store+"/"+tc.spec+"/"+sealed, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			capture := func(t *testing.T, writers int) (*atStore, *manifest.Manifest) {
				st := &atStore{Store: stores[tc.store](t)}
				out, err := NewSealedArchiveOutput(ctx, st, 512<<10, tc.seal)
				if err != nil {
					t.Fatal(err)
				}
				out.streamID = 0x5eed // a sealed archive's comes from the session
				out.SetWriters(writers)
				c, err := NewCapture(ctx, out, Options{ChunkSize: 256 << 10, Workers: 3, Codec: mustSpec(t, tc.spec)})
				if err != nil {
					t.Fatal(err)
				}
				// One producer: the frames' order, so the bytes, are fixed.
				for i, name := range names {
					if _, err := c.WriteFile(name, reader(files[name], i), strings.HasPrefix(name, "ext-")); err != nil {
						t.Fatal(err)
					}
				}
				m, err := c.Close(ctx, manifest.Manifest{ID: "same", Host: "h", Created: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)})
				if err != nil {
					t.Fatal(err)
				}
				return st, m
			}
			one, m1 := capture(t, 1)
			if n := one.payloads.Load(); n != 0 {
				t.Fatalf("one writer: %d payload writes at offsets, want none", n)
			}
			if len(m1.Segments) < 2 {
				t.Fatalf("%d segments: the corpus should span several", len(m1.Segments))
			}
			want := storeObjects(t, one)
			for _, writers := range []int{2, 8} {
				several, _ := capture(t, writers)
				if several.payloads.Load() == 0 {
					t.Fatalf("%d writers: no payload written at an offset", writers)
				}
				got := storeObjects(t, several)
				if len(got) != len(want) {
					t.Fatalf("%d writers: %d objects, one writer: %d", writers, len(got), len(want))
				}
				for name, b := range want {
					if !bytes.Equal(got[name], b) {
						t.Fatalf("%d writers: %s differs (%d bytes, one writer's %d)", writers, name, len(got[name]), len(b))
					}
				}
				src, err := OpenArchive(ctx, several, Options{Key: keyIf(tc.seal, k), VerifyHashes: true})
				if err != nil {
					t.Fatal(err)
				}
				checkSource(t, ctx, fmt.Sprintf("%d writers", writers), src, files)
				src.Close()
			}
		})
	}
}

func keyIf(s *crypt.Session, k *crypt.Key) *crypt.Key {
	if s == nil {
		return nil
	}
	return k
}

// A payload write that fails fails the capture with the segment's name;
// nothing is committed and no manifest is written.
func TestArchiveWriteAtFails(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, kind := range []string{"mem", "dir"} {
		t.Run(kind, func(t *testing.T) {
			base := countGoroutines()
			st := &atStore{Store: mem.New(t.Name())}
			if kind == "dir" {
				st.Store = dir.New(t.TempDir())
			}
			bad := manifest.SegmentName(1)
			st.fail = func(name string, p []byte, off int64) error {
				if name == bad && len(p) >= minAsyncPayload && off > 300<<10 {
					return errBoom
				}
				return nil
			}
			out, err := NewArchiveOutput(ctx, st, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			out.SetWriters(4)
			c, err := NewCapture(ctx, out, Options{ChunkSize: 128 << 10, Workers: 2, Codec: mustSpec(t, "none")})
			if err != nil {
				t.Fatal(err)
			}
			_, werr := c.WriteFile("pages-1.img", &patternReader{n: 6 << 20}, false)
			_, cerr := c.Close(ctx, manifest.Manifest{})
			if !errors.Is(cerr, errBoom) || !strings.Contains(cerr.Error(), bad) {
				t.Fatalf("Close = %v, want %v naming %s (WriteFile: %v)", cerr, errBoom, bad, werr)
			}
			if werr != nil && !errors.Is(werr, errBoom) {
				t.Fatalf("WriteFile = %v", werr)
			}
			if objs := storeObjects(t, st); len(objs) != 0 {
				t.Fatalf("store keeps %d objects after a failed payload write", len(objs))
			}
			if _, err := ReadManifest(ctx, st); err == nil {
				t.Fatal("a manifest was written")
			}
			waitGoroutines(t, base)
		})
	}
}

// Abort waits for the payload writes in flight before it removes the
// segments, and every payload is handed back before it returns.
func TestArchiveAbortWaitsForWrites(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	gate := make(chan struct{})
	st := &atStore{Store: mem.New(t.Name())}
	st.fail = func(name string, p []byte, off int64) error {
		if len(p) >= minAsyncPayload {
			<-gate
		}
		return nil
	}
	out, err := NewArchiveOutput(ctx, st, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	out.SetWriters(2)
	var handed atomic.Int32
	for i := range 2 {
		fh := manifest.FrameHeader{Type: manifest.FrameData, Offset: uint64(i) << 20, RawLen: 1 << 20}
		if _, err := out.WriteFrameAsync(ctx, &fh, make([]byte, 1<<20), func(err error) {
			if err != nil {
				t.Errorf("payload write: %v", err)
			}
			handed.Add(1)
		}); err != nil {
			t.Fatal(err)
		}
	}
	aborted := make(chan error, 1)
	go func() { aborted <- out.Abort(ctx) }()
	select {
	case err := <-aborted:
		t.Fatalf("Abort returned (%v) with payload writes in flight", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(gate)
	if err := <-aborted; err != nil {
		t.Fatal(err)
	}
	if n := handed.Load(); n != 2 {
		t.Fatalf("%d of 2 payloads handed back when Abort returned", n)
	}
	if names := st.Store.(*mem.Store).Names(); len(names) != 0 {
		t.Fatalf("store keeps %v after Abort", names)
	}
}
