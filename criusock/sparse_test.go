package criusock

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"reflect"
	"testing"

	mmimg "github.com/checkpoint-restore/go-criu/v7/crit/images/mm"
	vmaimg "github.com/checkpoint-restore/go-criu/v7/crit/images/vma"
	"google.golang.org/protobuf/proto"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/source"
)

func sp(off, n int64) source.Span { return source.Span{Off: off, Len: n} }

const (
	vmaFilePrivate = 1 << 6
	mib            = 1 << 20
)

// image is a CRIU image of magic with these entries.
func image(magic uint32, entries ...[]byte) []byte {
	b := binary.LittleEndian.AppendUint32(nil, imgCommonMagic)
	b = binary.LittleEndian.AppendUint32(b, magic)
	for _, e := range entries {
		b = binary.LittleEndian.AppendUint32(b, uint32(len(e)))
		b = append(b, e...)
	}
	return b
}

// pagemapImg is a pagemap of pagesID with entries, counted as CRIU 4
// does (wide) or as older ones did.
func pagemapImg(pagesID uint32, wide bool, entries ...pagemapEntry) []byte {
	head := []byte{0x08, byte(pagesID)} // pages_id < 128
	return encodePagemap(image(pagemapMagic, head), entries, wide)
}

type vma struct {
	start, end    uint64
	status, flags uint32
}

func mmImg(t testing.TB, vmas ...vma) []byte {
	var m mmimg.MmEntry
	for _, v := range vmas {
		start, end, status, flags := v.start, v.end, v.status, v.flags
		m.Vmas = append(m.Vmas, &vmaimg.VmaEntry{Start: &start, End: &end, Status: &status, Flags: &flags})
	}
	b, err := proto.MarshalOptions{AllowPartial: true}.Marshal(&m)
	if err != nil {
		t.Fatal(err)
	}
	return image(mmMagic, b)
}

const (
	anon     = vmaAreaRegular | vmaAnonPrivate
	heap     = vmaAreaRegular | vmaAnonPrivate | vmaAreaHeap
	filePriv = vmaAreaRegular | vmaFilePrivate
)

func TestSparseEntries(t *testing.T) {
	const p = pageSize
	for _, tc := range []struct {
		name    string
		entries []pagemapEntry
		vmas    []vmaRange
		zero    []source.Span
		kept    []pagemapEntry
		omit    []source.Span
	}{
		{
			name:    "no zero pages",
			entries: []pagemapEntry{{0x1000, 4, 4}},
			vmas:    []vmaRange{{0, 1 << 40}},
			kept:    []pagemapEntry{{0x1000, 4, 4}},
		},
		{
			name:    "a zero run in the middle",
			entries: []pagemapEntry{{0x10000, 8, 6}},
			vmas:    []vmaRange{{0x10000, 0x20000}},
			zero:    []source.Span{sp(2*p, 3*p)},
			kept:    []pagemapEntry{{0x10000, 2, 6}, {0x15000, 3, 6}},
			omit:    []source.Span{sp(2*p, 3*p)},
		},
		{
			name:    "a zero run across two entries, merged where the pages image is contiguous",
			entries: []pagemapEntry{{0x10000, 4, 6}, {0x40000, 4, 6}},
			vmas:    []vmaRange{{0x10000, 0x50000}},
			zero:    []source.Span{sp(2*p, 4*p)},
			kept:    []pagemapEntry{{0x10000, 2, 6}, {0x42000, 2, 6}},
			omit:    []source.Span{sp(2*p, 4*p)},
		},
		{
			name:    "zero pages outside any eligible VMA stay",
			entries: []pagemapEntry{{0x10000, 4, 4}, {0x30000, 4, 4}},
			vmas:    []vmaRange{{0x30000, 0x32000}},
			zero:    []source.Span{sp(0, 8*p)},
			kept:    []pagemapEntry{{0x10000, 4, 4}, {0x32000, 2, 4}},
			omit:    []source.Span{sp(4*p, 2*p)},
		},
		{
			name:    "an entry spanning two VMAs with a gap between",
			entries: []pagemapEntry{{0x10000, 6, 6}},
			vmas:    []vmaRange{{0x10000, 0x12000}, {0x14000, 0x16000}},
			zero:    []source.Span{sp(0, 6*p)},
			kept:    []pagemapEntry{{0x12000, 2, 6}},
			omit:    []source.Span{sp(0, 2*p), sp(4*p, 2*p)},
		},
		{
			name:    "overlapping VMAs (a damaged mm image) cut each page once",
			entries: []pagemapEntry{{0x10000, 8, 6}},
			vmas:    []vmaRange{{0x10000, 0x16000}, {0x12000, 0x14000}, {0x13000, 0x18000}},
			zero:    []source.Span{sp(0, 8*p)},
			omit:    []source.Span{sp(0, 8*p)},
		},
		{
			name:    "a zero span not on pages cuts only its whole pages",
			entries: []pagemapEntry{{0x10000, 4, 6}},
			vmas:    []vmaRange{{0x10000, 0x14000}},
			zero:    []source.Span{sp(100, 2*p)},
			kept:    []pagemapEntry{{0x10000, 1, 6}, {0x12000, 2, 6}},
			omit:    []source.Span{sp(p, p)},
		},
		{
			name:    "all of it",
			entries: []pagemapEntry{{0x10000, 3, 6}},
			vmas:    []vmaRange{{0x10000, 0x13000}},
			zero:    []source.Span{sp(0, 3*p)},
			omit:    []source.Span{sp(0, 3*p)},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var size int64
			for _, e := range tc.entries {
				size += int64(e.nr) * p
			}
			kept, omit, err := sparseEntries(tc.entries, tc.vmas, tc.zero, size)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(kept, tc.kept) || !reflect.DeepEqual(omit, tc.omit) {
				t.Fatalf("kept %v, omit %v\nwant %v, %v", kept, omit, tc.kept, tc.omit)
			}
		})
	}
	if _, _, err := sparseEntries([]pagemapEntry{{0x1000, 4, 4}}, nil, nil, 3*p); err == nil {
		t.Fatal("a pagemap listing more pages than its pages image holds was accepted")
	}
}

func TestZeroPages(t *testing.T) {
	z, n := uint8(codec.Zero), uint8(codec.None)
	got := zeroPages([]manifest.Chunk{
		{Offset: 0, RawLen: 4096, Codec: n},
		{Offset: 4096, RawLen: 8192, Codec: z},
		{Offset: 12288, RawLen: 4096, Codec: z},  // touches the one before: merged
		{Offset: 16384, RawLen: 5000, Codec: z},  // ends inside a page: its whole page only
		{Offset: 21384, RawLen: 3000, Codec: z},  // no whole page
		{Offset: 24384, RawLen: 12000, Codec: z}, // starts inside a page
	})
	want := []source.Span{sp(4096, 16384), sp(24576, 8192)}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("zeroPages = %v, want %v", got, want)
	}
}

// fakeSource serves files from memory, the chunks as given (a unit test
// of sparse alone: the real sources' Omit is tested in package source).
type fakeSource struct {
	files  map[string][]byte
	chunks map[string][]manifest.Chunk
}

func (f *fakeSource) Stat(_ context.Context, name string) (manifest.File, error) {
	b, ok := f.files[name]
	if !ok {
		return manifest.File{}, fmt.Errorf("%s: %w", name, errdefs.ErrNotFound)
	}
	return manifest.File{Name: name, Size: int64(len(b)), Chunks: f.chunks[name]}, nil
}

func (f *fakeSource) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	if _, err := f.Stat(ctx, name); err != nil {
		return 0, err
	}
	b := f.files[name]
	for len(b) > 0 { // in pieces, as sources write chunks
		k := min(len(b), 100000)
		if _, err := w.Write(b[:k]); err != nil {
			return 0, err
		}
		b = b[k:]
	}
	return int64(len(f.files[name])), nil
}

func (f *fakeSource) Files(context.Context) ([]manifest.File, error) { return nil, nil }
func (f *fakeSource) Close() error                                   { return nil }

// sparseFixture is one process: 4 MiB of private anonymous memory whose
// middle 2 MiB are zero, 1 MiB of a file's private mapping all zero, and
// 1 MiB of a stack that grows down, all zero; in 1 MiB chunks.
func sparseFixture(t testing.TB, wide bool) (*fakeSource, []byte) {
	const a, f, s = 0x10000000, 0x20000000, 0x30000000
	pages := make([]byte, 6*mib)
	r := pipelinetest.NewRand(3)
	pipelinetest.FillRandom(pages[:mib], r)
	pipelinetest.FillRandom(pages[3*mib:4*mib], r)
	var chunks []manifest.Chunk
	for i := range int64(6) {
		c := manifest.Chunk{Offset: i * mib, RawLen: mib, Codec: uint8(codec.Zero)}
		if i == 0 || i == 3 {
			c.Codec = uint8(codec.None)
		}
		chunks = append(chunks, c)
	}
	src := &fakeSource{files: map[string][]byte{
		"pagemap-42.img": pagemapImg(7, wide, pagemapEntry{a, 1024, 6}, pagemapEntry{f, 256, 4}, pagemapEntry{s, 256, 6}),
		"pages-7.img":    pages,
		"mm-42.img": mmImg(t, vma{a, a + 4*mib, heap, 0x22}, vma{f, f + mib, filePriv, 0x2},
			vma{s, s + mib, anon | vmaAreaStack, 0x122}),
		"core-42.img": {1, 2, 3},
	}, chunks: map[string][]manifest.Chunk{"pages-7.img": chunks}}
	return src, pages
}

func serveAll(t *testing.T, src source.Source, names ...string) map[string][]byte {
	t.Helper()
	out := map[string][]byte{}
	for _, name := range names {
		f, err := src.Stat(context.Background(), name)
		if err != nil {
			t.Fatal(err)
		}
		var buf bytes.Buffer
		n, err := src.Copy(context.Background(), name, &buf)
		if err != nil {
			t.Fatalf("Copy(%s): %v", name, err)
		}
		if f.Size != int64(buf.Len()) || n != f.Size {
			t.Fatalf("%s: Stat says %d bytes, Copy returned %d and wrote %d", name, f.Size, n, buf.Len())
		}
		out[name] = buf.Bytes()
	}
	return out
}

// The pagemap asked for first is rewritten without the zero pages of
// private anonymous memory, and the pages image is served without them;
// the file's private mapping and the stack keep theirs.
func TestSparseServe(t *testing.T) {
	for _, wide := range []bool{true, false} {
		t.Run(fmt.Sprintf("wide=%v", wide), func(t *testing.T) {
			src, pages := sparseFixture(t, wide)
			sp := newSparse(src, func(s string) { t.Log(s) })
			got := serveAll(t, sp, "pagemap-42.img", "pages-7.img", "core-42.img", "pagemap-42.img", "pages-7.img")
			pm, err := parsePagemap(got["pagemap-42.img"])
			if err != nil || !pm.plain || pm.pagesID != 7 || pm.wide != wide {
				t.Fatalf("served pagemap: %+v, %v", pm, err)
			}
			want := []pagemapEntry{{0x10000000, 256, 6}, {0x10300000, 256, 6}, {0x20000000, 256, 4}, {0x30000000, 256, 6}}
			if !reflect.DeepEqual(pm.entries, want) {
				t.Fatalf("served entries %v, want %v", pm.entries, want)
			}
			if w := append(append([]byte(nil), pages[:mib]...), pages[3*mib:]...); !bytes.Equal(got["pages-7.img"], w) {
				t.Fatalf("served pages: %d bytes, want %d", len(got["pages-7.img"]), len(w))
			}
			if !bytes.Equal(got["core-42.img"], src.files["core-42.img"]) || sp.Omitted() != 2*mib {
				t.Fatalf("core served changed, or Omitted() = %d, want %d", sp.Omitted(), 2*mib)
			}
		})
	}
}

// What cannot be rewritten is served as it is: a pages image asked for
// before its pagemap, a pagemap with pages in a parent image, an mm image
// that is not one.
func TestSparseServeAsIs(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(*fakeSource)
		order  []string
	}{
		{"pages first", func(*fakeSource) {}, []string{"pages-7.img", "pagemap-42.img"}},
		{"in a parent image", func(f *fakeSource) {
			f.files["pagemap-42.img"] = pagemapImg(7, true, pagemapEntry{0x10000000, 1024, 1 | pePresent}, pagemapEntry{0x20000000, 512, 4})
		}, []string{"pagemap-42.img", "pages-7.img"}},
		{"a damaged mm image", func(f *fakeSource) { f.files["mm-42.img"] = []byte("not an image") }, []string{"pagemap-42.img", "pages-7.img"}},
		{"no zero chunks", func(f *fakeSource) { f.chunks = nil }, []string{"pagemap-42.img", "pages-7.img"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src, _ := sparseFixture(t, true)
			tc.change(src)
			sp := newSparse(src, func(s string) { t.Log(s) })
			got := serveAll(t, sp, tc.order...)
			for _, name := range tc.order {
				if !bytes.Equal(got[name], src.files[name]) {
					t.Fatalf("%s was changed", name)
				}
			}
			if sp.Omitted() != 0 {
				t.Fatalf("Omitted() = %d", sp.Omitted())
			}
		})
	}
}

func FuzzParsePagemap(f *testing.F) {
	f.Add(pagemapImg(7, true, pagemapEntry{0x10000000, 1024, 6}, pagemapEntry{0x20000000, 256, 4}))
	f.Add(pagemapImg(3, false, pagemapEntry{0x1000, 1, 4}))
	f.Add(image(pagemapMagic, []byte{0x08, 0x01}, []byte{0x08, 0x80, 0x20, 0x10, 0x00, 0x20, 0x06, 0x28, 0x01, 0x30, 0x05}))
	f.Fuzz(func(t *testing.T, b []byte) {
		pm, err := parsePagemap(b)
		if err != nil || !pm.plain {
			return
		}
		// A plain pagemap encodes back to the same entries.
		again, err := parsePagemap(encodePagemap(b, pm.entries, pm.wide))
		if err != nil || !again.plain || again.pagesID != pm.pagesID || !reflect.DeepEqual(again.entries, pm.entries) {
			t.Fatalf("re-encoded %+v as %+v, %v", pm, again, err)
		}
		var total uint64
		for _, e := range pm.entries {
			total += e.nr
		}
		// Cutting zero spans (here not on pages) in VMAs (here
		// overlapping) keeps every page either kept or left out.
		size := int64(total) * pageSize
		vmas := []vmaRange{{0, 1 << 47}, {0x1000, 0x5000}}
		kept, omit, err := sparseEntries(pm.entries, vmas, []source.Span{sp(pageSize/3, max(1, size/2))}, size)
		if err != nil {
			return
		}
		var k, o int64
		for _, e := range kept {
			k += int64(e.nr) * pageSize
		}
		for _, s := range omit {
			o += s.Len
		}
		if k+o != size {
			t.Fatalf("kept %d + omitted %d bytes of %d", k, o, size)
		}
	})
}

func FuzzParseMM(f *testing.F) {
	f.Add(mmImg(f, vma{0x1000, 0x3000, heap, 0x22}, vma{0x5000, 0x6000, filePriv, 2}))
	f.Add(image(mmMagic))
	f.Fuzz(func(t *testing.T, b []byte) {
		vmas, err := parseMM(b)
		if err != nil {
			return
		}
		for i, v := range vmas {
			if v.start >= v.end || v.start%pageSize != 0 || (i > 0 && vmas[i-1].start > v.start) {
				t.Fatalf("VMA %d: %+v", i, v)
			}
		}
	})
}
