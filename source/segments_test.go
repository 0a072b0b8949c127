package source

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/streamer"
)

// segmentCorpus is newArchiveCorpus's archive, encrypted under key when it
// is not nil.
func segmentCorpus(t *testing.T, key *crypt.Key) *archiveCorpus {
	t.Helper()
	ctx := context.Background()
	ac := &archiveCorpus{files: corpusFiles(), store: mem.New("corpus")}
	opts := pipeline.Options{ChunkSize: corpusChunk, Workers: 2, Codec: pipelinetest.MustSpec(t, "auto"), Key: key}
	f, err := opts.NewFormat()
	if err != nil {
		t.Fatal(err)
	}
	out, err := streamer.NewArchiveOutputAs(ctx, ac.store, 150<<10, f)
	if err != nil {
		t.Fatal(err)
	}
	ac.m = captureFiles(t, ctx, out, opts, ac.files)
	if len(ac.m.Segments) < 2 {
		t.Fatalf("corpus archive has %d segments, want several", len(ac.m.Segments))
	}
	return ac
}

// unread are the bytes of each segment that no chunk's read covers: all
// but the frames of the chunks the manifest lists stored (not zero).
func unread(m *manifest.Manifest) map[int][]int64 {
	covered := map[int]map[int64]bool{}
	for _, f := range m.Files {
		for _, c := range f.Chunks {
			if codec.ID(c.Codec) == codec.Zero {
				continue
			}
			if covered[c.Segment] == nil {
				covered[c.Segment] = map[int64]bool{}
			}
			for i := range manifest.FrameSize + int64(c.Stored) {
				covered[c.Segment][c.Pos+i] = true
			}
		}
	}
	out := map[int][]int64{}
	for i, s := range m.Segments {
		for off := range s.Size {
			if !covered[i][off] {
				out[i] = append(out[i], off)
			}
		}
	}
	return out
}

// TestCheckSegments flips, one at a time, every byte of every segment that
// no chunk's read covers (stream header, KEY, FILE, FILE-END and END
// frames, zero chunks' frames, the tail): a restore still reads every file
// right (it never reads them), and VerifyArchive, through CheckSegments,
// fails with ErrCorrupt naming the segment and an offset. Plain and
// encrypted (KEY frame, sealed zero chunks).
func TestCheckSegments(t *testing.T) {
	key, err := crypt.NewKey(bytes.Repeat([]byte{9}, crypt.KeySize))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		key  *crypt.Key
	}{{"plain", nil}, {"encrypted", key}} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			ac := segmentCorpus(t, tc.key)
			a, err := OpenArchive(ctx, ac.store, pipeline.Options{Workers: 2, Key: tc.key, VerifyHashes: true})
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			if _, err := VerifyArchive(ctx, a); err != nil {
				t.Fatalf("undamaged: %v", err)
			}
			flipped := 0
			for si, offs := range unread(ac.m) {
				seg := ac.m.Segments[si].Name
				obj := ac.store.Object(seg)
				for _, off := range offs {
					obj[off] ^= 0x10
					err := CheckSegments(ctx, a)
					if off%97 == 0 {
						// now and then: the restore does not read it
						if errs := copyAll(t, ctx, a, ac.files); len(errs) > 0 {
							t.Fatalf("%s byte %d damaged: a restore failed: %v", seg, off, errs)
						}
					}
					obj[off] ^= 0x10
					if !errors.Is(err, errdefs.ErrCorrupt) || !strings.Contains(err.Error(), seg+" at offset ") {
						t.Fatalf("%s byte %d damaged: CheckSegments: %v, want ErrCorrupt naming the segment", seg, off, err)
					}
					flipped++
				}
			}
			t.Logf("%d bytes flipped", flipped)
			if flipped < 1000 {
				t.Fatalf("only %d bytes flipped", flipped)
			}
		})
	}
}

// TestFrameFields: a chunk's frame header rewritten, its CRC made right
// again, so that only the manifest can tell: fetch (a stored chunk) and
// CheckSegments (a zero chunk) name the field's byte.
func TestFrameFields(t *testing.T) {
	ctx := context.Background()
	ac := segmentCorpus(t, nil)
	a, err := OpenArchive(ctx, ac.store, pipeline.Options{Workers: 2, VerifyHashes: true})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	kinds := map[bool]manifest.Chunk{} // zero or not: the first chunk
	for _, f := range ac.m.Files {
		for _, c := range f.Chunks {
			if _, ok := kinds[codec.ID(c.Codec) == codec.Zero]; !ok {
				kinds[codec.ID(c.Codec) == codec.Zero] = c
			}
		}
	}
	if len(kinds) != 2 {
		t.Fatal("the corpus has no zero chunk or no stored one")
	}
	for zero, c := range kinds {
		obj := ac.store.Object(ac.m.Segments[c.Segment].Name)
		hdr := obj[c.Pos : c.Pos+manifest.FrameSize]
		orig := bytes.Clone(hdr)
		for _, field := range []struct {
			at     int
			change func(*manifest.FrameHeader)
		}{
			{1, func(fh *manifest.FrameHeader) { fh.Codec ^= 3 }},
			{2, func(fh *manifest.FrameHeader) { fh.Flags = 1 }},
			{8, func(fh *manifest.FrameHeader) { fh.Offset++ }},
			{16, func(fh *manifest.FrameHeader) { fh.RawLen-- }},
			{20, func(fh *manifest.FrameHeader) { fh.StoredLen++ }},
			{24, func(fh *manifest.FrameHeader) { fh.Checksum++ }},
			{28, func(fh *manifest.FrameHeader) { fh.Hash[5]++ }},
		} {
			fh, err := manifest.UnmarshalFrameHeader(orig)
			if err != nil {
				t.Fatal(err)
			}
			field.change(&fh)
			fh.Marshal(hdr)
			_, err = VerifyArchive(ctx, a)
			copy(hdr, orig)
			want := fmt.Sprintf("header byte %d,", field.at)
			if zero && field.at == 20 {
				want = "runs past" // into the next frame: before the manifest is asked
			}
			if !errors.Is(err, errdefs.ErrCorrupt) || !strings.Contains(err.Error(), want) {
				t.Errorf("zero chunk %v, header byte %d rewritten: %v, want ErrCorrupt with %q", zero, field.at, err, want)
			}
		}
	}
}

// TestCheckSegmentsEndTag: in an encrypted segment, a frame header no
// chunk's read covers rewritten and its CRC made right again, so that only
// the END tag (FORMAT.md section 15.4) can tell: CheckSegments recomputes
// it and fails with ErrCorrupt naming the segment. The END tag itself
// rewritten so, too.
func TestCheckSegmentsEndTag(t *testing.T) {
	ctx := context.Background()
	key, err := crypt.NewKey(bytes.Repeat([]byte{9}, crypt.KeySize))
	if err != nil {
		t.Fatal(err)
	}
	ac := segmentCorpus(t, key)
	a, err := OpenArchive(ctx, ac.store, pipeline.Options{Workers: 2, Key: key, VerifyHashes: true})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	seg := ac.m.Segments[0].Name
	obj := ac.store.Object(seg)
	rd, err := manifest.NewReader(bytes.NewReader(obj), seg)
	if err != nil {
		t.Fatal(err)
	}
	first := map[manifest.FrameType]int64{} // the first frame of each type
	for {
		fr, err := rd.Next(nil)
		if err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		if _, ok := first[fr.Type]; !ok {
			first[fr.Type] = fr.Pos
		}
	}
	for _, tc := range []struct {
		name   string
		typ    manifest.FrameType
		change func(*manifest.FrameHeader)
	}{
		{"END tag", manifest.FrameEnd, func(fh *manifest.FrameHeader) { fh.Hash[5] ^= 1 }},
		{"FILE-END digest", manifest.FrameFileEnd, func(fh *manifest.FrameHeader) { fh.Hash[0] ^= 1 }},
		{"FILE-END size", manifest.FrameFileEnd, func(fh *manifest.FrameHeader) { fh.Offset++ }},
		{"FILE flags", manifest.FrameFile, func(fh *manifest.FrameHeader) { fh.Flags ^= manifest.FileFlagExternal }},
	} {
		pos, ok := first[tc.typ]
		if !ok {
			t.Fatalf("%s: segment %s has no %s frame", tc.name, seg, tc.typ)
		}
		hdr := obj[pos : pos+manifest.FrameSize]
		orig := bytes.Clone(hdr)
		fh, err := manifest.UnmarshalFrameHeader(orig)
		if err != nil {
			t.Fatal(err)
		}
		tc.change(&fh)
		fh.Marshal(hdr)
		err = CheckSegments(ctx, a)
		copy(hdr, orig)
		if !errors.Is(err, errdefs.ErrCorrupt) || !strings.Contains(err.Error(), seg+" at offset ") || !strings.Contains(err.Error(), "END frame") {
			t.Errorf("%s rewritten, its CRC made right: CheckSegments: %v, want ErrCorrupt naming %s and its END frame", tc.name, err, seg)
		}
	}
	if err := CheckSegments(ctx, a); err != nil {
		t.Fatalf("undamaged: %v", err)
	}
}
