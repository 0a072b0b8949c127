package streamer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/testwait"
)

// syncOnly hides an output's WriteFrameAsync: a capture writes it the
// synchronous way.
type syncOnly struct{ Output }

func (s syncOnly) Format() pipeline.Format { return FormatOf(s.Output) }

// liveShards are pipes that a stream source reads while the capture
// writes; every byte is also recorded.
type liveShards struct {
	ws   []io.Writer
	pws  []*io.PipeWriter
	bufs []*bytes.Buffer
	src  *source.StreamSource
}

func newLiveShards(ctx context.Context, n int, key *crypt.Key) *liveShards {
	l := &liveShards{}
	rs := make([]io.Reader, n)
	names := make([]string, n)
	for i := range n {
		pr, pw := io.Pipe()
		buf := &bytes.Buffer{}
		l.ws = append(l.ws, io.MultiWriter(pw, buf))
		l.pws = append(l.pws, pw)
		l.bufs = append(l.bufs, buf)
		rs[i], names[i] = pr, fmt.Sprintf("shard %d", i)
	}
	l.src = source.NewStreamSource(ctx, rs, names, source.StreamSourceOptions{Options: pipeline.Options{MemoryLimit: 64 << 20, Key: key, VerifyHashes: true}})
	return l
}

// close ends the pipes, with err where the writer failed.
func (l *liveShards) close(err error) {
	for _, pw := range l.pws {
		pw.CloseWithError(err)
	}
}

// captureInOrder writes files in order into out and closes the capture.
func captureInOrder(ctx context.Context, out Output, names []string, files map[string][]byte, spec string, t testing.TB) (*manifest.Manifest, error) {
	c, err := NewCapture(ctx, out, pipeline.Options{ChunkSize: 128 << 10, Workers: 2, Codec: pipelinetest.MustSpec(t, spec)})
	if err != nil {
		return nil, err
	}
	for _, n := range names {
		if _, err := c.WriteFile(n, bytes.NewReader(files[n]), false); err != nil {
			break
		}
	}
	// Fixed, so that two captures write the same trailer.
	return c.Close(ctx, manifest.Manifest{ID: "output-test", Host: "test", Created: time.Unix(1e9, 0).UTC()})
}

// checkFramePositions checks that every chunk of m points at its DATA frame in
// the shard (Segment) it names.
func checkFramePositions(t *testing.T, m *manifest.Manifest, shards []*bytes.Buffer) {
	t.Helper()
	n := 0
	for _, f := range m.Files {
		for _, ch := range f.Chunks {
			b := shards[ch.Segment].Bytes()
			fh, err := manifest.UnmarshalFrameHeader(b[ch.Pos : ch.Pos+manifest.FrameSize])
			if err != nil || fh.Type != manifest.FrameData || fh.Offset != uint64(ch.Offset) || fh.StoredLen != ch.Stored {
				t.Fatalf("%s chunk at %d: shard %d offset %d holds %+v (%v)", f.Name, ch.Offset, ch.Segment, ch.Pos, fh, err)
			}
			n++
		}
	}
	if n == 0 {
		t.Fatal("no chunk to check")
	}
}

// The asynchronous StreamOutput writes the stream the synchronous one
// does: the same bytes on every shard (the plain stream's header names a
// random stream), read back live by a stream source, with every chunk
// where the index says.
func TestStreamOutputAsync(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	files := lanesCorpus()
	names := slices.Sorted(maps.Keys(files))
	k := pipelinetest.Key(t, 9)
	session := pipelinetest.Session(t, k)
	for _, shards := range []int{1, 2, 4} {
		for _, seal := range []*crypt.Session{nil, session} {
			kind := "plain"
			if seal != nil {
				kind = "sealed"
			}
			t.Run(fmt.Sprintf("%d-%s", shards, kind), func(t *testing.T) {
				base := pipelinetest.CountGoroutines()
				var got [2][]*bytes.Buffer
				for i, async := range []bool{false, true} {
					live := newLiveShards(ctx, shards, keyIf(seal, k))
					so, err := NewStreamOutputAs(live.ws, pipeline.Format{Seal: seal})
					if err != nil {
						t.Fatal(err)
					}
					var out Output = so
					if !async {
						out = syncOnly{so}
					}
					m, err := captureInOrder(ctx, out, names, files, "none", t)
					live.close(err)
					if err != nil {
						t.Fatal(err)
					}
					if async != (so.chains != nil) {
						t.Fatalf("async %v, but the output wrote asynchronously: %v", async, so.chains != nil)
					}
					pipelinetest.CheckSource(t, ctx, fmt.Sprintf("async %v", async), live.src, files)
					live.src.Close()
					checkFramePositions(t, m, live.bufs)
					for s, n := range so.Sizes() {
						if n != int64(live.bufs[s].Len()) {
							t.Fatalf("Sizes()[%d] = %d, the shard holds %d bytes", s, n, live.bufs[s].Len())
						}
					}
					got[i] = live.bufs
				}
				for s := range shards {
					a, b := got[0][s].Bytes(), got[1][s].Bytes()
					if seal == nil {
						a, b = a[manifest.HeaderSize:], b[manifest.HeaderSize:]
					}
					if !bytes.Equal(a, b) {
						t.Fatalf("shard %d: %d bytes written asynchronously differ from the %d written synchronously", s, len(b), len(a))
					}
				}
				pipelinetest.WaitGoroutines(t, base)
			})
		}
	}
}

// failingWriter fails every write once after bytes were written.
type failingWriter struct {
	after int
	n     int
}

func (w *failingWriter) Write(p []byte) (int, error) {
	if w.n+len(p) > w.after {
		return 0, errBoom
	}
	w.n += len(p)
	return len(p), nil
}

// A shard whose writer fails fails the capture with its name; the other
// shards' chains end, no goroutine is left.
func TestStreamOutputAsyncShardFails(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	files := lanesCorpus()
	names := slices.Sorted(maps.Keys(files))
	for _, tc := range []struct{ shards, bad int }{{1, 0}, {2, 1}, {4, 2}} {
		t.Run(fmt.Sprintf("%d-shards-%d-fails", tc.shards, tc.bad), func(t *testing.T) {
			base := pipelinetest.CountGoroutines()
			ws := make([]io.Writer, tc.shards)
			for i := range ws {
				ws[i] = io.Discard
			}
			ws[tc.bad] = &failingWriter{after: 300 << 10}
			so, err := NewStreamOutput(ws)
			if err != nil {
				t.Fatal(err)
			}
			_, err = captureInOrder(ctx, so, names, files, "none", t)
			want := fmt.Sprintf("shard %d", tc.bad)
			if !errors.Is(err, errBoom) || !strings.Contains(err.Error(), want) {
				t.Fatalf("capture = %v, want %v naming %q", err, errBoom, want)
			}
			pipelinetest.WaitGoroutines(t, base)
		})
	}
}

// gatedWriter holds every write until gate closes.
type gatedWriter struct {
	gate    chan struct{}
	started chan struct{} // one send per write that waits
}

func (w *gatedWriter) Write(p []byte) (int, error) {
	select {
	case w.started <- struct{}{}:
	default:
	}
	<-w.gate
	return len(p), nil
}

// Abort drops the frames still queued and waits for the write in
// progress; every payload is handed back before it returns.
func TestStreamOutputAsyncAbortWaits(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	base := pipelinetest.CountGoroutines()
	w := &gatedWriter{gate: make(chan struct{}), started: make(chan struct{}, 1)}
	so, err := NewStreamOutput([]io.Writer{io.Discard, w})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	results := map[int]error{}
	const frames = 6 // 3 per shard; shard 1 holds its first in Write
	for i := range frames {
		p := make([]byte, 512<<10) // beyond the shard's buffer: written at once
		fh := manifest.FrameHeader{Type: manifest.FrameData, Offset: uint64(i) * uint64(len(p)), RawLen: uint32(len(p)), StoredLen: uint32(len(p))}
		if _, err := so.WriteFrameAsync(ctx, &fh, p, func(err error) {
			mu.Lock()
			results[i] = err
			mu.Unlock()
		}); err != nil {
			t.Fatal(err)
		}
	}
	<-w.started
	aborted := make(chan error, 1)
	go func() { aborted <- so.Abort(ctx) }()
	select {
	case err := <-aborted:
		t.Fatalf("Abort returned (%v) with a write in progress", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(w.gate)
	if err := <-aborted; err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(results) != frames {
		t.Fatalf("%d of %d payloads handed back when Abort returned", len(results), frames)
	}
	// Shard 1's first frame (index 1) was being written; its later ones
	// (3, 5) were dropped.
	for _, i := range []int{3, 5} {
		if !errors.Is(results[i], errStreamAborted) {
			t.Fatalf("frame %d queued behind the abort: %v, want %v", i, results[i], errStreamAborted)
		}
	}
	if results[1] != nil {
		t.Fatalf("frame 1, written during the abort: %v", results[1])
	}
	fh := manifest.FrameHeader{Type: manifest.FrameData, RawLen: 1, StoredLen: 1}
	if _, err := so.WriteFrameAsync(ctx, &fh, []byte{1}, func(error) { t.Error("done called for a refused frame") }); !errors.Is(err, errStreamAborted) {
		t.Fatalf("write after Abort = %v, want %v", err, errStreamAborted)
	}
	pipelinetest.WaitGoroutines(t, base)
}

// handshakeWriter passes a shard's bytes on only once its partner has
// started writing too: synchronous writes one after the other never get
// there, writes at once do.
type handshakeWriter struct {
	me, partner chan struct{}
	once        sync.Once
	w           io.Writer
}

func (h *handshakeWriter) Write(p []byte) (int, error) {
	if len(p) >= 64<<10 {
		h.once.Do(func() { close(h.me) })
		select {
		case <-h.partner:
		case <-time.After(testwait.Scale(5 * time.Second)):
			return 0, errors.New("the other side of the tee never wrote at the same time")
		}
	}
	return h.w.Write(p)
}

// A tee of two asynchronous outputs writes both sides at once; the index
// is the copy's, and both sides read back.
func TestTeeOutputAsync(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	files := lanesCorpus()
	names := slices.Sorted(maps.Keys(files))
	k := pipelinetest.Key(t, 11)
	for _, seal := range []*crypt.Session{nil, pipelinetest.Session(t, k)} {
		t.Run(fmt.Sprint("sealed=", seal != nil), func(t *testing.T) {
			base := pipelinetest.CountGoroutines()
			peer := newLiveShards(ctx, 2, keyIf(seal, k))
			local := newLiveShards(ctx, 1, keyIf(seal, k))
			a, b := make(chan struct{}), make(chan struct{})
			peer.ws[1] = &handshakeWriter{me: a, partner: b, w: peer.ws[1]}
			local.ws[0] = &handshakeWriter{me: b, partner: a, w: local.ws[0]}
			primary, err := NewStreamOutputAs(peer.ws, pipeline.Format{Seal: seal})
			if err != nil {
				t.Fatal(err)
			}
			cp, err := NewStreamOutputAs(local.ws, pipeline.Format{Seal: seal})
			if err != nil {
				t.Fatal(err)
			}
			m, err := captureInOrder(ctx, TeeOutput{Primary: primary, Copy: cp}, names, files, "none", t)
			peer.close(err)
			local.close(err)
			if err != nil {
				t.Fatal(err)
			}
			pipelinetest.CheckSource(t, ctx, "peer", peer.src, files)
			pipelinetest.CheckSource(t, ctx, "local copy", local.src, files)
			peer.src.Close()
			local.src.Close()
			for _, f := range m.Files {
				for _, ch := range f.Chunks {
					if ch.Segment != 0 {
						t.Fatalf("%s: chunk in segment %d: the index is not the copy's", f.Name, ch.Segment)
					}
				}
			}
			checkFramePositions(t, m, local.bufs)
			pipelinetest.WaitGoroutines(t, base)
		})
	}
}

// A tee whose copy refuses a frame hands the payload back only after the
// primary's write of it ended, and calls no done; one side without
// WriteFrameAsync makes the tee write the synchronous way.
func TestTeeOutputAsyncRefusedAndMixed(t *testing.T) {
	ctx := context.Background()
	w := &gatedWriter{gate: make(chan struct{}), started: make(chan struct{}, 1)}
	primary, err := NewStreamOutput([]io.Writer{w})
	if err != nil {
		t.Fatal(err)
	}
	cp, err := NewStreamOutput([]io.Writer{io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	fh := manifest.FrameHeader{Type: manifest.FrameData, RawLen: 512 << 10, StoredLen: 512 << 10}
	if _, err := cp.WriteFrameAsync(ctx, &fh, make([]byte, 512<<10), func(error) {}); err != nil {
		t.Fatal(err)
	}
	cp.Abort(ctx)
	var written atomic.Bool
	go func() {
		<-w.started
		time.Sleep(50 * time.Millisecond)
		written.Store(true)
		close(w.gate)
	}()
	tee := TeeOutput{Primary: primary, Copy: cp}
	_, err = tee.WriteFrameAsync(ctx, &fh, make([]byte, 512<<10), func(error) { t.Error("done called for a refused frame") })
	if !errors.Is(err, errStreamAborted) {
		t.Fatalf("tee write = %v, want %v", err, errStreamAborted)
	}
	if !written.Load() {
		t.Fatal("the tee handed the payload back while the primary still wrote it")
	}
	if err := primary.Abort(ctx); err != nil {
		t.Fatal(err)
	}

	var peer, local bytes.Buffer
	p2, err := NewStreamOutput([]io.Writer{&peer})
	if err != nil {
		t.Fatal(err)
	}
	c2, err := NewStreamOutput([]io.Writer{&local})
	if err != nil {
		t.Fatal(err)
	}
	files := lanesCorpus()
	names := slices.Sorted(maps.Keys(files))
	if _, err := captureInOrder(ctx, TeeOutput{Primary: syncOnly{p2}, Copy: c2}, names, files, "none", t); err != nil {
		t.Fatal(err)
	}
	if p2.chains != nil || c2.chains != nil {
		t.Fatal("a tee with one synchronous side wrote asynchronously")
	}
	if !bytes.Equal(peer.Bytes()[manifest.HeaderSize:], local.Bytes()[manifest.HeaderSize:]) {
		t.Fatal("the two sides of the tee differ")
	}
}
