package source

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/streamer"
)

// segFixture is a small plain archive for FuzzCheckSegments: its store,
// manifest and a source opened on it (for its checked manifest and seal).
type segFixture struct {
	name  string
	store *mem.Store
	a     *ArchiveSource
}

// segmentFuzzFixture writes a small archive of several segments,
// deterministically (one worker, one lane, files one after the other):
// an input means the same damage in every process only if the layout is
// the same there. Its files cover each kind of frame CheckSegments reads:
// FILE, FILE-END, END, zero chunks' DATA frames, the DATA frames of a
// file written twice (the manifest lists the later copy), an empty file,
// compressed and stored chunks; with key, the KEY frame and sealed zero
// chunks; hashes: chunk hashes in a plain archive (FORMAT.md 8.1).
func segmentFuzzFixture(tb testing.TB, name string, key *crypt.Key, hashes bool) *segFixture {
	tb.Helper()
	ctx := context.Background()
	r := pipelinetest.NewRand(7)
	text := make([]byte, 9000)
	pipelinetest.FillText(text, r)
	noise := make([]byte, 5000)
	pipelinetest.FillRandom(noise, r)
	pages := append(append(pipelinetest.SmallData(3000, 3), make([]byte, 3*4096)...), pipelinetest.SmallData(2000, 4)...)
	files := []struct {
		name string
		data []byte
	}{
		{"inventory.img", pipelinetest.SmallData(700, 1)},
		{"twice.img", pipelinetest.SmallData(5000, 5)},
		{"text.img", text},
		{"empty.img", nil},
		{"pages-1.img", pages},
		{"noise.img", noise},
		{"twice.img", pipelinetest.SmallData(4500, 6)}, // the copy the manifest lists
	}
	st := mem.New(name)
	opts := pipeline.Options{ChunkSize: 4096, Workers: 1, Codec: pipelinetest.MustSpec(tb, "auto"), Key: key, ChunkHashes: hashes}
	f, err := opts.NewFormat()
	if err != nil {
		tb.Fatal(err)
	}
	out, err := streamer.NewArchiveOutputAs(ctx, st, 6<<10, f)
	if err != nil {
		tb.Fatal(err)
	}
	out.SetLanes(1)
	c, err := streamer.NewCapture(ctx, out, opts)
	if err != nil {
		tb.Fatal(err)
	}
	for _, f := range files {
		if _, err := c.WriteFile(f.name, bytes.NewReader(f.data), false); err != nil {
			tb.Fatal(err)
		}
	}
	m, err := c.Close(ctx, manifest.Manifest{Tool: "segments-fuzz"})
	if err != nil {
		tb.Fatal(err)
	}
	if len(m.Segments) < 3 {
		tb.Fatalf("%s: %d segments, want several", name, len(m.Segments))
	}
	a, err := OpenArchive(ctx, st, pipeline.Options{Workers: 2, Key: key, VerifyHashes: true})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { a.Close() })
	if err := CheckSegments(ctx, a); err != nil {
		tb.Fatalf("%s undamaged: %v", name, err)
	}
	return &segFixture{name: name, store: st, a: a}
}

// segLayout is where a manifest places the frames it lists, and its
// segments' sizes: equal layouts, equal segments but for the stream id,
// nonces and seals.
func segLayout(m *manifest.Manifest) string {
	var b strings.Builder
	for _, s := range m.Segments {
		fmt.Fprintf(&b, "%d ", s.Size)
	}
	for _, f := range m.Files {
		for _, c := range f.Chunks {
			fmt.Fprintf(&b, "%s:%d:%d:%d:%d ", f.Name, c.Segment, c.Pos, c.Stored, c.Codec)
		}
	}
	return b.String()
}

// resealSegment makes the CRCs of a (damaged) segment right again: the
// stream header's and, walking the frames as their stored lengths place
// them, each frame header's and each non-DATA payload's, up to the END
// frame or where a frame runs past the end. Damage that only a hostile
// writer could make, for the fuzzer to get past the CRCs to the rules
// behind them.
func resealSegment(b []byte) {
	if len(b) < manifest.HeaderSize {
		return
	}
	binary.LittleEndian.PutUint32(b[28:], manifest.PayloadChecksum(b[:28]))
	for pos := manifest.HeaderSize; pos+manifest.FrameSize <= len(b); {
		h := b[pos : pos+manifest.FrameSize]
		end := pos + manifest.FrameSize + int(binary.LittleEndian.Uint32(h[20:]))
		typ := manifest.FrameType(h[0])
		if end <= len(b) && typ != manifest.FrameData {
			binary.LittleEndian.PutUint32(h[24:], manifest.PayloadChecksum(b[pos+manifest.FrameSize:end]))
		}
		binary.LittleEndian.PutUint32(h[60:], manifest.PayloadChecksum(h[:60]))
		if typ == manifest.FrameEnd {
			return
		}
		pos = end
	}
}

// segFrame is a frame of a segment as equivalentSegment compares them.
type segFrame struct {
	pos     int64
	hdr     manifest.FrameHeader
	payload []byte
}

// segFrames walks a segment CheckSegments passed: the header, frames up
// to the END frame, the tail. The frames the manifest lists (listed: their
// stored lengths by place) are passed over as fetch reads them, not
// decoded: CheckSegments does not read them.
func segFrames(b []byte, listed map[int64]uint32) (hdr manifest.Header, frames []segFrame, tail []byte, err error) {
	if hdr, err = manifest.UnmarshalHeader(b); err != nil {
		return hdr, nil, nil, err
	}
	pos := int64(manifest.HeaderSize)
	for {
		if pos+manifest.FrameSize > int64(len(b)) {
			return hdr, nil, nil, errors.New("no END frame")
		}
		if n, ok := listed[pos]; ok {
			frames = append(frames, segFrame{pos: pos, hdr: manifest.FrameHeader{Type: manifest.FrameData, StoredLen: n}})
			pos += manifest.FrameSize + int64(n)
			continue
		}
		fh, err := manifest.UnmarshalFrameHeader(b[pos:])
		if err != nil {
			return hdr, nil, nil, err
		}
		end := pos + manifest.FrameSize + int64(fh.StoredLen)
		if end > int64(len(b)) {
			return hdr, nil, nil, errors.New("a frame runs past the end")
		}
		frames = append(frames, segFrame{pos, fh, b[pos+manifest.FrameSize : end]})
		pos = end
		if fh.Type == manifest.FrameEnd {
			return hdr, frames, b[pos:], nil
		}
	}
}

// equivalentSegment says whether bad, a segment CheckSegments passed in
// place of orig with its CRCs remade (resealSegment), is orig to a reader
// of the archive. A reader of an archive takes from a segment only the
// frames the manifest lists (and fetch checks those); the rest must be a
// well-formed segment, but a writer that remakes CRCs can say other
// things in it that no reader uses, and CheckSegments, which knows only
// the manifest, cannot tell: a plain manifest records no file ids, so
// neither a FILE frame's name nor the file id of a frame nor FILE-END's
// size, count and digest (those of the copy it ends: the manifest's are
// the archive's); and section 4's "others: 0" fields and FILE's raw
// length (readers do not rely on them) are not its to check. So bad must
// have: the same stream id and shard; the same frames, at the same places
// with the same types and payload lengths, up to the same END frame and
// tail; each zero chunk's frame as it was (CheckSegments matches it with
// the manifest); each other DATA frame the manifest does not list (a file
// written twice) as it was but for its file id and offset (decoded and
// checked as any chunk, but read by no restore); the KEY frame's cipher,
// stream id, salt and key id as they were.
func equivalentSegment(orig, bad []byte, listed map[int64]uint32, zeros map[int64]bool) error {
	oh, of, ot, err := segFrames(orig, listed)
	if err != nil {
		return fmt.Errorf("the original: %v", err)
	}
	bh, bf, bt, err := segFrames(bad, listed)
	if err != nil {
		return err
	}
	switch {
	case oh.StreamID != bh.StreamID || oh.ShardIndex != bh.ShardIndex || oh.ShardCount != bh.ShardCount:
		return fmt.Errorf("stream header %+v, was %+v", bh, oh)
	case !bytes.Equal(ot, bt):
		return fmt.Errorf("tail %x, was %x", bt, ot)
	case len(of) != len(bf):
		return fmt.Errorf("%d frames, were %d", len(bf), len(of))
	}
	for i, o := range of {
		b := bf[i]
		switch {
		case o.pos != b.pos || o.hdr.Type != b.hdr.Type || o.hdr.StoredLen != b.hdr.StoredLen:
			return fmt.Errorf("frame %d: %s at %d with %d payload bytes, was %s at %d with %d",
				i, b.hdr.Type, b.pos, b.hdr.StoredLen, o.hdr.Type, o.pos, o.hdr.StoredLen)
		case hasKey(listed, o.pos):
		case o.hdr.Type == manifest.FrameData && zeros[o.pos]:
			if o.hdr != b.hdr || !bytes.Equal(o.payload, b.payload) {
				return fmt.Errorf("zero chunk's frame at %d: %+v, was %+v", o.pos, b.hdr, o.hdr)
			}
		case o.hdr.Type == manifest.FrameData:
			h := b.hdr
			h.FileID, h.Offset = o.hdr.FileID, o.hdr.Offset
			if h != o.hdr || !bytes.Equal(o.payload, b.payload) {
				return fmt.Errorf("unlisted DATA frame at %d: %+v, was %+v", o.pos, b.hdr, o.hdr)
			}
		case o.hdr.Type == manifest.FrameKey:
			if o.hdr.Codec != b.hdr.Codec || o.hdr.Offset != b.hdr.Offset || o.hdr.Hash != b.hdr.Hash || !bytes.Equal(o.payload, b.payload) {
				return fmt.Errorf("KEY frame: %+v, was %+v", b.hdr, o.hdr)
			}
		}
	}
	return nil
}

// FuzzCheckSegments damages one segment of a small archive (bytes
// written over it, put into it, cut from it, or its end replaced), with
// its CRCs made right again or not, and the manifest's size of it
// following the damage or not, and runs CheckSegments: it must not panic,
// must return within seconds, must allocate no more than a few MiB (a
// length read from the bytes bounds nothing by itself), and must either
// fail with an error wrapping errdefs.ErrCorrupt that names the segment
// and an offset, or pass a segment that says what the original did: the
// original bytes but in the frames the manifest lists (fetch reads them),
// or, CRCs remade, the same frames but for what no reader of an archive
// takes from a segment and the manifest cannot tell (equivalentSegment).
//
// As FuzzDedupRuns does, each input damages a store of its own, and the
// fixtures are written deterministically, checked to be so with another
// GOMAXPROCS: a failure found in one worker is the same input elsewhere.
func FuzzCheckSegments(f *testing.F) {
	key, err := crypt.NewKey(bytes.Repeat([]byte{9}, crypt.KeySize))
	if err != nil {
		f.Fatal(err)
	}
	build := func() []*segFixture {
		return []*segFixture{
			segmentFuzzFixture(f, "plain", nil, false),
			segmentFuzzFixture(f, "hashes", nil, true),
			segmentFuzzFixture(f, "sealed", key, false),
		}
	}
	fixtures := build()
	other := 1
	if runtime.GOMAXPROCS(0) == 1 {
		other = 4
	}
	prev := runtime.GOMAXPROCS(other)
	again := build()
	runtime.GOMAXPROCS(prev)
	for i, fx := range fixtures {
		if segLayout(again[i].a.man) != segLayout(fx.a.man) {
			f.Fatalf("%s: the fixture differs with GOMAXPROCS %d and %d: an input would not mean the same damage everywhere", fx.name, prev, other)
		}
	}

	// What each segment's frames are: listed (fetch reads them) or zero
	// chunks' (CheckSegments matches them with the manifest).
	type segInfo struct {
		listed map[int64]uint32 // stored length by place
		zeros  map[int64]bool
	}
	infos := make([][]segInfo, len(fixtures))
	for i, fx := range fixtures {
		m := fx.a.man
		infos[i] = make([]segInfo, len(m.Segments))
		for s := range infos[i] {
			infos[i][s] = segInfo{map[int64]uint32{}, map[int64]bool{}}
		}
		for _, fl := range m.Files {
			for _, c := range fl.Chunks {
				if c.Segment < 0 {
					continue
				}
				if codec.ID(c.Codec) == codec.Zero {
					infos[i][c.Segment].zeros[c.Pos] = true
				} else {
					infos[i][c.Segment].listed[c.Pos] = c.Stored
				}
			}
		}
	}

	// Seeds: every segment as it is (it must pass), and a few kinds of
	// damage at the places that matter.
	const (
		opOver = iota
		opInsert
		opCut
		opDelete
		nOps
		flagReseal = 1 << 2
		flagAgree  = 1 << 3
	)
	for fi, fx := range fixtures {
		for s := range fx.a.man.Segments {
			f.Add(uint8(fi), uint8(s), uint32(0), []byte(nil), uint8(opOver))
		}
	}
	for fi := range fixtures {
		f.Add(uint8(fi), uint8(0), uint32(20), []byte{0xff}, uint8(opOver|flagReseal)) // the stream id
		// an END frame of 48 MiB (under MaxPayload, and END's type sets no
		// bound of its own): only the segment's end bounds what is read
		end48 := make([]byte, 24)
		end48[0], end48[23] = byte(manifest.FrameEnd), 3
		f.Add(uint8(fi), uint8(1), uint32(manifest.HeaderSize), end48, uint8(opOver|flagReseal))
		f.Add(uint8(fi), uint8(1), uint32(manifest.HeaderSize), []byte{byte(manifest.FrameData)}, uint8(opOver|flagReseal))
		f.Add(uint8(fi), uint8(0), uint32(manifest.HeaderSize+16), []byte{0, 0, 0, 4}, uint8(opOver|flagReseal))
		f.Add(uint8(fi), uint8(2), uint32(200), []byte("xyz"), uint8(opInsert|flagReseal|flagAgree))
		f.Add(uint8(fi), uint8(1), uint32(5000), []byte(nil), uint8(opCut|flagAgree))
		f.Add(uint8(fi), uint8(0), uint32(100), make([]byte, 64), uint8(opDelete|flagReseal|flagAgree))
	}

	f.Fuzz(func(t *testing.T, fixture, seg uint8, at uint32, over []byte, op uint8) {
		fx := fixtures[int(fixture)%len(fixtures)]
		m := fx.a.man
		si := int(seg) % len(m.Segments)
		info := infos[int(fixture)%len(fixtures)][si]
		name := m.Segments[si].Name
		orig := fx.store.Object(name)
		at %= uint32(len(orig) + 1)
		var bad []byte
		switch op % nOps {
		case opOver:
			bad = bytes.Clone(orig)
			copy(bad[at:], over)
		case opInsert:
			bad = slices.Concat(orig[:at], over, orig[at:])
		case opCut: // the end replaced: cut, or cut and other bytes after
			bad = slices.Concat(orig[:at], over)
		case opDelete:
			bad = slices.Concat(orig[:at], orig[min(int(at)+len(over), len(orig)):])
		}
		if op&flagReseal != 0 {
			resealSegment(bad)
		}
		input := fmt.Sprintf("%s segment %d of %d (%d bytes), op %d at %d with %d bytes, reseal %t, the manifest's size follows %t: %d bytes",
			fx.name, si, len(m.Segments), len(orig), op%nOps, at, len(over), op&flagReseal != 0, op&flagAgree != 0, len(bad))

		// The fixture's objects are never written: this input's store
		// shares them, and holds its own damaged segment.
		st := mem.New(fx.name)
		for _, n := range fx.store.Names() {
			st.Put(n, fx.store.Object(n))
		}
		st.Put(name, bad)
		mm := m
		if op&flagAgree != 0 && len(bad) != len(orig) {
			// A plain manifest is as open to damage as a segment: one
			// that agrees with the damaged size, if it is still one
			// OpenArchive would take.
			c := *m
			c.Segments = slices.Clone(m.Segments)
			c.Segments[si].Size = int64(len(bad))
			if c.Validate() != nil {
				return
			}
			mm = &c
		}
		a := newArchiveSource(st, mm, fx.a.seal, fx.a.opts)
		defer a.Close()

		stop := time.AfterFunc(10*time.Second, func() { panic(input + ": CheckSegments still running after 10s\n" + pipelinetest.GoroutineDump()) })
		var ms0, ms1 runtime.MemStats
		runtime.ReadMemStats(&ms0)
		err := CheckSegments(context.Background(), a)
		runtime.ReadMemStats(&ms1)
		stop.Stop()
		if alloc := ms1.TotalAlloc - ms0.TotalAlloc; alloc > 4<<20 {
			t.Fatalf("%s: CheckSegments allocated %d bytes", input, alloc)
		}
		if err != nil {
			if !errors.Is(err, errdefs.ErrCorrupt) || !strings.Contains(err.Error(), " at offset ") {
				t.Fatalf("%s: %v, want ErrCorrupt naming a segment and an offset", input, err)
			}
			return
		}
		// Passed: the segment says what the original did.
		if len(bad) == len(orig) {
			same := true
			for off := range bad {
				if bad[off] != orig[off] && !coveredByListed(int64(off), info.listed) {
					same = false
					break
				}
			}
			if same {
				return
			}
		}
		if op&flagReseal == 0 { // a CRC, or the tail, must have caught it
			t.Fatalf("%s: CheckSegments passed a segment that differs outside the frames the manifest lists", input)
		}
		if err := equivalentSegment(orig, bad, info.listed, info.zeros); err != nil {
			t.Fatalf("%s: CheckSegments passed a segment that differs: %v", input, err)
		}
	})
}

// coveredByListed says whether off lies in the frame of a chunk the
// manifest lists (listed: stored lengths by place), which fetch reads and
// checks.
func coveredByListed(off int64, listed map[int64]uint32) bool {
	for pos, n := range listed {
		if off >= pos && off < pos+manifest.FrameSize+int64(n) {
			return true
		}
	}
	return false
}

func hasKey[K comparable, V any](m map[K]V, k K) bool { _, ok := m[k]; return ok }
