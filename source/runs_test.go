package source

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/streamer"
)

// writeAtOnce writes every file into c, each from a goroutine of its own
// (as CRIU's images and the VRAM files arrive together).
func writeAtOnce(tb testing.TB, c *streamer.Capture, files map[string][]byte) {
	var wg sync.WaitGroup
	for n, data := range files {
		wg.Go(func() {
			if _, err := c.WriteFile(n, bytes.NewReader(data), false); err != nil {
				tb.Error(err)
			}
		})
	}
	wg.Wait()
}

// runsCapture writes files at once, on one lane, as a format 4 checkpoint
// "ckpt" of loc: their chunks alternate in the packs, so that runs step
// over each other's frames.
func runsCapture(t *testing.T, loc store.Store, files map[string][]byte) *manifest.Manifest {
	t.Helper()
	ctx := context.Background()
	out, err := streamer.NewDedupOutput(ctx, store.Sub(loc, "ckpt"), loc, 8<<20, nil)
	if err != nil {
		t.Fatal(err)
	}
	out.SetLanes(1)
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: 1 << 20, Workers: 2, Codec: pipelinetest.MustSpec(t, "lz4")})
	if err != nil {
		t.Fatal(err)
	}
	writeAtOnce(t, c, files)
	m, err := c.Close(ctx, manifest.Manifest{Tool: "test"})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// runShape says what the runs of an archive hold: runs of several chunks,
// runs that step over other frames, runs read in two pieces (two packs),
// and runs mixing chunks stored raw (checked in place) with encoded ones.
func runShape(a *ArchiveSource) (multi, gapped, split, mixed int) {
	for _, f := range a.man.Files {
		for _, r := range a.runs[f.Name] {
			if r.n < 2 {
				continue
			}
			multi++
			cs := f.Chunks[r.first : r.first+r.n]
			pieces := [][]manifest.Chunk{cs}
			if r.split > 0 {
				split++
				pieces = [][]manifest.Chunk{cs[:r.split], cs[r.split:]}
			}
			var frames int64
			codecs := map[codec.ID]bool{}
			for _, c := range cs {
				frames += manifest.FrameSize + int64(c.Stored)
				codecs[codec.ID(c.Codec)] = true
			}
			var span int64
			for _, p := range pieces {
				span += spanOf(p)
			}
			if span > frames {
				gapped++
			}
			if len(codecs) > 1 {
				mixed++
			}
		}
	}
	return multi, gapped, split, mixed
}

// A run's chunks stored raw are checked and written where they were read,
// the others decoded: through a pipe (vmsplice, a small pipe so that the
// pieces go in several calls) and by Write; read from a directory (only
// the run's frames, packed) and from memory (the whole span). The counters
// count what was read.
func TestDedupRunsRestore(t *testing.T) {
	ctx := context.Background()
	files := map[string][]byte{}
	for i := range 3 {
		files[fmt.Sprintf("pages-%d.img", i)] = pagesImage(2048, uint64(i+1)) // 8 MiB
	}
	for kind, loc := range map[string]store.Store{"dir": dir.New(t.TempDir()), "mem": mem.New("loc")} {
		t.Run(kind, func(t *testing.T) {
			m := runsCapture(t, loc, files)
			var raw, stored int64
			for _, f := range m.Files {
				for _, c := range f.Chunks {
					if codec.ID(c.Codec) != codec.Zero {
						raw, stored = raw+int64(c.RawLen), stored+int64(c.Stored)
					}
				}
			}
			a, err := OpenArchive(ctx, store.Sub(loc, "ckpt"), pipeline.Options{VerifyHashes: true})
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			multi, gapped, split, mixed := runShape(a)
			t.Logf("%d runs of several chunks, %d stepping over other frames, %d in two packs, %d mixing raw and encoded chunks", multi, gapped, split, mixed)
			if gapped == 0 || split == 0 || mixed == 0 {
				t.Fatalf("the capture made no run stepping over other frames (%d), none in two packs (%d) or none mixing codecs (%d): nothing tested", gapped, split, mixed)
			}
			for name, want := range files {
				for _, nonblock := range []bool{false, true} {
					got, err := copyThroughPipe(ctx, a, name, nonblock, -1)
					if err != nil {
						t.Fatalf("%s through a pipe (nonblock %v): %v", name, nonblock, err)
					}
					if !bytes.Equal(got, want) {
						t.Fatalf("%s through a pipe (nonblock %v): %d bytes read, want %d, not equal", name, nonblock, len(got), len(want))
					}
				}
				var buf bytes.Buffer
				if _, err := a.Copy(ctx, name, &buf); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(buf.Bytes(), want) {
					t.Fatalf("%s by Write: %d bytes, want %d, not equal", name, buf.Len(), len(want))
				}
			}
			if got, want := a.Counters.StoredRaw.Load(), 3*raw; got != want {
				t.Errorf("StoredRaw %d after three copies, want %d", got, want)
			}
			if got, want := a.Counters.StoredBytes.Load(), 3*stored; got != want {
				t.Errorf("StoredBytes %d after three copies, want %d", got, want)
			}
		})
	}
}

// A damaged frame in a run, stored raw or encoded, or a pack cut short,
// is an error naming the pack and the frame's offset, and nothing of the
// run is written.
func TestDedupRunsDamage(t *testing.T) {
	ctx := context.Background()
	files := map[string][]byte{}
	for i := range 2 {
		files[fmt.Sprintf("pages-%d.img", i)] = pagesImage(2048, uint64(i+7))
	}
	root := t.TempDir()
	m := runsCapture(t, dir.New(root), files)
	// A chunk stored raw and an encoded one, each inside a run.
	type target struct {
		file  string
		chunk manifest.Chunk
		run   int64 // where its run starts in the file
	}
	var raw, enc, second *target // second: in a run's second pack
	a, err := OpenArchive(ctx, store.Sub(dir.New(root), "ckpt"), pipeline.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range m.Files {
		for _, r := range a.runs[f.Name] {
			for i, c := range f.Chunks[r.first+1 : r.first+r.n] {
				tg := &target{f.Name, c, f.Chunks[r.first].Offset}
				switch {
				case second == nil && r.split > 0 && i+1 >= r.split:
					second = tg
				case raw == nil && codec.ID(c.Codec) == codec.None:
					raw = tg
				case enc == nil && codec.ID(c.Codec) == codec.LZ4:
					enc = tg
				}
			}
		}
	}
	a.Close()
	if raw == nil || enc == nil || second == nil {
		t.Fatalf("no run holds a raw chunk (%v) or an lz4 one (%v) after its first, or one in a second pack (%v)", raw != nil, enc != nil, second != nil)
	}
	for _, tc := range []struct {
		name string
		tg   *target
		at   int64 // what is damaged, from the frame's start; -1: the pack ends at the frame's middle
	}{
		{"raw payload", raw, manifest.FrameSize + 100},
		{"lz4 payload", enc, manifest.FrameSize + int64(enc.chunk.Stored) - 1},
		{"frame header", raw, 8},
		{"pack cut short", enc, -1},
		{"in the second pack", second, manifest.FrameSize + int64(second.chunk.Stored) - 1},
		{"second pack cut short", second, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.tg.chunk
			pack := filepath.Join(root, filepath.FromSlash(m.Segments[c.Segment].Name))
			orig, err := os.ReadFile(pack)
			if err != nil {
				t.Fatal(err)
			}
			defer os.WriteFile(pack, orig, 0o600)
			bad := bytes.Clone(orig)
			if tc.at < 0 {
				bad = bad[:c.Pos+manifest.FrameSize+int64(c.Stored)/2]
			} else {
				bad[c.Pos+tc.at] ^= 0x40
			}
			if err := os.WriteFile(pack, bad, 0o600); err != nil {
				t.Fatal(err)
			}
			a, err := OpenArchive(ctx, store.Sub(dir.New(root), "ckpt"), pipeline.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			for _, pipe := range []bool{false, true} {
				var got []byte
				if pipe {
					got, err = copyThroughPipe(ctx, a, tc.tg.file, false, -1)
				} else {
					var buf bytes.Buffer
					_, err = a.Copy(ctx, tc.tg.file, &buf)
					got = buf.Bytes()
				}
				if !errors.Is(err, errdefs.ErrCorrupt) {
					t.Fatalf("pipe %v: %v, want corrupt", pipe, err)
				}
				where := fmt.Sprintf("%s at offset %d", m.Segments[c.Segment].Name, c.Pos)
				if tc.at < 0 {
					where = m.Segments[c.Segment].Name // the run's first frame
				}
				if !strings.Contains(err.Error(), where) {
					t.Errorf("pipe %v: %q does not name %q", pipe, err, where)
				}
				if int64(len(got)) > tc.tg.run || !bytes.Equal(got, files[tc.tg.file][:len(got)]) {
					t.Fatalf("pipe %v: %d bytes written before the error, the damaged run starts at %d", pipe, len(got), tc.tg.run)
				}
			}
		})
	}
}

// dedupRunsFixture is FuzzDedupRuns's checkpoint: two files in a
// location of their own, in packs of 256 KiB (runs in two). One lane, so
// that it is the same in every process: the coordinator's, each worker's,
// a replay's.
func dedupRunsFixture(tb testing.TB) (*mem.Store, *manifest.Manifest, map[string][]byte) {
	ctx := context.Background()
	files := map[string][]byte{"a.img": pagesImage(96, 1), "b.img": pagesImage(64, 2)}
	loc := mem.New("loc")
	out, err := streamer.NewDedupOutput(ctx, store.Sub(loc, "ckpt"), loc, 256<<10, nil)
	if err != nil {
		tb.Fatal(err)
	}
	out.SetLanes(1)
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: 128 << 10, Workers: 1, Codec: pipelinetest.MustSpec(tb, "lz4")})
	if err != nil {
		tb.Fatal(err)
	}
	for _, n := range []string{"a.img", "b.img"} {
		if _, err := c.WriteFile(n, bytes.NewReader(files[n]), false); err != nil {
			tb.Fatal(err)
		}
	}
	m, err := c.Close(ctx, manifest.Manifest{Tool: "test"})
	if err != nil {
		tb.Fatal(err)
	}
	return loc, m, files
}

// layout is where a checkpoint's chunks lie: pack index, place, size.
func layout(m *manifest.Manifest) string {
	var b strings.Builder
	for _, f := range m.Files {
		for _, c := range f.Chunks {
			fmt.Fprintf(&b, "%d:%d:%d ", c.Segment, c.Pos, c.Stored)
		}
	}
	return b.String()
}

// FuzzDedupRuns damages a pack of a deduplicated checkpoint (bytes
// written over it at an offset, or the pack cut there) and restores every
// file: each is its bytes exactly or an error wrapping errdefs.ErrCorrupt,
// never other bytes or a panic.
//
// An input means the same damage in every process only if the fixture is
// the same there: it was written on GOMAXPROCS lanes, so the packs and
// what pack index seg names depended on the machine, and a failure found
// in one worker was another input in the worker that minimizes it and in
// a replay elsewhere. Each input damages a store of its own: the shared
// one was damaged in place and put back by a defer, and every input after
// one that did not get there would have run against a damaged fixture.
// What fails names its input, since Go records no crasher for a failure
// outside an input (the setup, a seed in the warm-up, a worker killed by
// a signal such as the OOM killer's).
func FuzzDedupRuns(f *testing.F) {
	ctx := context.Background()
	loc, m, files := dedupRunsFixture(f)
	// The same on a machine of another size.
	other := 1
	if runtime.GOMAXPROCS(0) == 1 {
		other = 4
	}
	prev := runtime.GOMAXPROCS(other)
	_, again, _ := dedupRunsFixture(f)
	runtime.GOMAXPROCS(prev)
	if layout(again) != layout(m) {
		f.Fatalf("the fixture differs with GOMAXPROCS %d and %d: an input would not mean the same damage everywhere", prev, other)
	}
	if len(m.Segments) < 2 {
		f.Fatalf("%d packs, want several", len(m.Segments))
	}
	f.Add(uint8(0), uint32(0), []byte{1}, false)
	f.Add(uint8(1), uint32(manifest.FrameSize+10), []byte{0xff, 0}, false)
	f.Add(uint8(0), uint32(100<<10), []byte(nil), true)
	f.Fuzz(func(t *testing.T, seg uint8, at uint32, over []byte, cut bool) {
		pack := m.Segments[int(seg)%len(m.Segments)].Name
		bad := bytes.Clone(loc.Object(pack))
		if int(at) > len(bad) {
			at %= uint32(len(bad) + 1)
		}
		if cut {
			bad = bad[:at]
		} else {
			copy(bad[at:], over)
		}
		// The fixture's objects are never written: this input's store
		// shares them, and holds its own damaged pack.
		st := mem.New("loc")
		for _, n := range loc.Names() {
			st.Put(n, loc.Object(n))
		}
		st.Put(pack, bad)
		input := fmt.Sprintf("pack %d of %d (%d bytes) at %d, %d bytes over it, cut %v", int(seg)%len(m.Segments), len(m.Segments), len(loc.Object(pack)), at, len(over), cut)
		a, err := OpenArchive(ctx, store.Sub(st, "ckpt"), pipeline.Options{})
		if err != nil {
			t.Fatalf("%s: %v", input, err)
		}
		defer a.Close()
		for name, want := range files {
			var buf bytes.Buffer
			_, err := a.Copy(ctx, name, &buf)
			if err != nil && !errors.Is(err, errdefs.ErrCorrupt) {
				t.Fatalf("%s: %s: %v, want corrupt", input, name, err)
			}
			if got := buf.Bytes(); !bytes.Equal(got, want[:min(len(got), len(want))]) || (err == nil && len(got) != len(want)) {
				t.Fatalf("%s: %s: %d bytes restored (error %v) are not the file's", input, name, len(got), err)
			}
		}
	})
}
