package chunkstore

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"io"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/mem"
)

// packBytes is a pack of chunks of the given payloads, as a writer lays it
// out (docs/FORMAT.md section 17.2), and its chunks, whose ids are tagged
// with tag.
func packBytes(id PackID, tag byte, payloads ...string) ([]byte, []Chunk) {
	var b bytes.Buffer
	b.Write(manifest.Header{Version: manifest.VersionSharedChunks, Flags: manifest.HeaderFlagPack, ShardCount: 1, StreamID: 7}.Marshal())
	var chunks []Chunk
	var fb [manifest.FrameSize]byte
	for i, p := range payloads {
		fh := manifest.FrameHeader{Type: manifest.FrameData, Codec: 0, RawLen: uint32(len(p)), StoredLen: uint32(len(p)),
			Checksum: crc32.Checksum([]byte(p), castagnoli)}
		fh.Hash[0], fh.Hash[1] = byte(i), tag
		chunks = append(chunks, Chunk{ID: fh.Hash, Ref: Ref{Pack: id, Pos: int64(b.Len()), RawLen: fh.RawLen, Stored: fh.StoredLen, Checksum: fh.Checksum}})
		fh.Marshal(fb[:])
		b.Write(fb[:])
		b.WriteString(p)
	}
	end := b.Len()
	(&manifest.FrameHeader{Type: manifest.FrameEnd}).Marshal(fb[:])
	b.Write(fb[:])
	b.Write(manifest.MarshalTail(uint64(end)))
	return b.Bytes(), chunks
}

// readerOnly hides a reader's Seek: DecodePack then reads past payloads.
type readerOnly struct{ io.Reader }

func decodeAll(b []byte, id PackID, seek bool) ([]Chunk, error) {
	var r io.Reader = readerOnly{bytes.NewReader(b)}
	if seek {
		r = bytes.NewReader(b)
	}
	var out []Chunk
	err := DecodePack(r, id, int64(len(b)), func(c Chunk) error {
		out = append(out, c)
		return nil
	})
	return out, err
}

func TestDecodePack(t *testing.T) {
	id := NewPackID()
	good, chunks := packBytes(id, 0, "alpha", "beta beta", "gamma gamma gamma")
	secondAt := chunks[1].Pos
	frameHeader := func(b []byte, pos int64) []byte { return b[pos : pos+manifest.FrameSize] }
	tests := []struct {
		name   string
		damage func(b []byte) []byte
		want   int    // chunks handed on
		errHas string // "" for none
	}{
		{"whole", func(b []byte) []byte { return b }, 3, ""},
		{"empty", func(b []byte) []byte { return nil }, 0, "pack header"},
		{"not a pack", func(b []byte) []byte {
			h := manifest.Header{Version: 1, ShardCount: 1}.Marshal()
			return append(h, b[manifest.HeaderSize:]...)
		}, 0, "not a pack"},
		{"frame header flipped", func(b []byte) []byte { frameHeader(b, secondAt)[5] ^= 1; return b }, 1, "offset " + itoa(secondAt)},
		{"truncated in a payload", func(b []byte) []byte { return b[:secondAt+manifest.FrameSize+3] }, 1, "offset " + itoa(secondAt)},
		{"truncated after a frame", func(b []byte) []byte { return b[:chunks[2].Pos] }, 2, "ends before its END frame"},
		{"no tail", func(b []byte) []byte { return b[:len(b)-manifest.TailSize] }, 3, "END frame"},
		{"bytes after the tail", func(b []byte) []byte { return append(b, 0) }, 3, "END frame"},
		{"tail points elsewhere", func(b []byte) []byte { b[len(b)-manifest.TailSize] ^= 1; return b }, 3, "tail"},
		{"a FILE frame", func(b []byte) []byte {
			fh := manifest.FrameHeader{Type: manifest.FrameFile, StoredLen: 9, RawLen: 9, Checksum: crc32.Checksum([]byte("beta beta"), castagnoli)}
			fh.Marshal(frameHeader(b, secondAt))
			return b
		}, 1, "FILE frame"},
		{"a zero chunk", func(b []byte) []byte {
			fh, _ := manifest.UnmarshalFrameHeader(frameHeader(b, secondAt))
			fh.Codec = 1
			fh.Marshal(frameHeader(b, secondAt))
			return b
		}, 1, "no chunk of a pack"},
		{"a payload past the end", func(b []byte) []byte {
			fh, _ := manifest.UnmarshalFrameHeader(frameHeader(b, secondAt))
			fh.StoredLen = 1 << 20
			fh.Marshal(frameHeader(b, secondAt))
			return b
		}, 1, "no chunk of a pack"},
	}
	for _, tc := range tests {
		for _, seek := range []bool{true, false} {
			got, err := decodeAll(tc.damage(bytes.Clone(good)), id, seek)
			if tc.errHas == "" {
				if err != nil || !slices.Equal(got, chunks) {
					t.Errorf("%s (seek %v): %v, %+v; want %+v", tc.name, seek, err, got, chunks)
				}
				continue
			}
			if !errors.Is(err, errdefs.ErrCorrupt) || !strings.Contains(err.Error(), tc.errHas) {
				t.Errorf("%s (seek %v): error %v, want one wrapping corrupt data that says %q", tc.name, seek, err, tc.errHas)
			}
			if !slices.Equal(got, chunks[:tc.want]) {
				t.Errorf("%s (seek %v): %d chunks before the damage, want %d", tc.name, seek, len(got), tc.want)
			}
		}
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// FuzzDecodePack: whatever the bytes, no panic; the chunks handed on lie
// in the pack, in offset order, with sane lengths; reading with and
// without seeking agree.
func FuzzDecodePack(f *testing.F) {
	id := PackID{1}
	good, _ := packBytes(id, 0, "alpha", "beta beta", "gamma gamma gamma")
	f.Add(good)
	f.Add(good[:len(good)/2])
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		seeked, errS := decodeAll(b, id, true)
		read, errR := decodeAll(b, id, false)
		if (errS == nil) != (errR == nil) || !slices.Equal(seeked, read) {
			t.Fatalf("seek: %v %d chunks; read: %v %d chunks", errS, len(seeked), errR, len(read))
		}
		at := int64(manifest.HeaderSize)
		for _, c := range read {
			if c.Pos < at || c.Pos+manifest.FrameSize+int64(c.Stored) > int64(len(b)) || c.RawLen == 0 || c.RawLen > manifest.MaxPayload || c.Pack != id {
				t.Fatalf("chunk %+v of a pack of %d bytes (next frame at %d or later)", c, len(b), at)
			}
			at = c.Pos + manifest.FrameSize + int64(c.Stored)
		}
		if errR != nil && !errors.Is(errR, errdefs.ErrCorrupt) && !errors.Is(errR, manifest.ErrNewerVersion) {
			t.Fatalf("error %v wraps neither corrupt data nor a newer version", errR)
		}
	})
}

// TestLoadSkipsBadIndex: a corrupt and a truncated index object are
// skipped and named, the good one loaded; an object of a newer version,
// or a store that fails, still fails the load.
func TestLoadSkipsBadIndex(t *testing.T) {
	ctx := context.Background()
	st := mem.New("loc")
	packs := testPacks(3)
	var names []string
	var sets [][]Chunk
	for i := range packs {
		chunks := randomChunks(50, packs[i:i+1], uint64(10+i))
		name, err := WriteIndex(ctx, st, packs[i:i+1], chunks)
		if err != nil {
			t.Fatal(err)
		}
		names, sets = append(names, name), append(sets, chunks)
	}
	b := get(t, st, names[0])
	b[len(b)/2] ^= 1
	put(t, st, names[0], b)
	put(t, st, names[1], get(t, st, names[1])[:100])
	tbl, err := Load(ctx, st)
	if err != nil {
		t.Fatal(err)
	}
	if tbl.Len() != 50 {
		t.Fatalf("%d chunks loaded, want the good object's 50", tbl.Len())
	}
	for _, c := range sets[2] {
		if r, ok := tbl.Lookup(c.ID); !ok || r != c.Ref {
			t.Fatalf("chunk of the good object: %+v %v", r, ok)
		}
	}
	for _, c := range append(sets[0], sets[1]...) {
		if tbl.Has(c.ID) {
			t.Fatalf("chunk %s of a bad object loaded", c.ID)
		}
	}
	bad := tbl.Skipped()
	want := slices.Sorted(slices.Values(names[:2]))
	if len(bad) != 2 || bad[0].Name != want[0] || bad[1].Name != want[1] {
		t.Fatalf("skipped %+v, want %v", bad, want)
	}
	for _, s := range bad {
		if !errors.Is(s.Err, errdefs.ErrCorrupt) || !strings.Contains(s.Err.Error(), s.Name) {
			t.Errorf("skipped %s: %v", s.Name, s.Err)
		}
	}

	// A newer version is no damage: this build cannot tell what it says.
	b = get(t, st, names[2])
	binary.LittleEndian.PutUint16(b[8:], manifest.VersionSharedChunks+1)
	binary.LittleEndian.PutUint32(b[28:], crc32.Checksum(b[:28], castagnoli))
	put(t, st, names[2], b)
	if _, err := Load(ctx, st); !errors.Is(err, manifest.ErrNewerVersion) {
		t.Fatalf("load with an index object of a newer version: %v", err)
	}
	if _, err := Load(ctx, failingOpen{st}); err == nil || errors.Is(err, errdefs.ErrCorrupt) {
		t.Fatalf("load from a store that fails: %v", err)
	}
}

// failingOpen is a store whose reads fail.
type failingOpen struct{ store.Store }

func (failingOpen) Open(context.Context, string, int64, int64) (io.ReadCloser, error) {
	return nil, errors.New("connection reset")
}

func get(t *testing.T, st store.Store, name string) []byte {
	t.Helper()
	r, err := st.Open(context.Background(), name, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func put(t *testing.T, st store.Store, name string, b []byte) {
	t.Helper()
	ctx := context.Background()
	w, err := st.Create(ctx, name)
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

// TestScanPacks: the scan of a location finds each pack's chunks, notes a
// damaged pack with the chunks before the damage, tells the index's
// entries that are not there (stale) from those past the damage (unknown)
// and the chunks no index lists, and writes an index that lists every
// chunk the packs hold and keeps what the old one said past the damage.
func TestScanPacks(t *testing.T) {
	ctx := context.Background()
	st := mem.New("loc")
	ids := []PackID{NewPackID(), NewPackID(), NewPackID()}
	present := map[PackID]int64{}
	var all [][]Chunk
	var packs []Pack
	for i, id := range ids {
		b, chunks := packBytes(id, byte(i), strings.Repeat("a", 10+i), strings.Repeat("b", 20+i))
		if i == 2 {
			b[chunks[1].Pos+3] ^= 1 // its second frame header damaged
		}
		put(t, st, id.Name(), b)
		present[id] = int64(len(b))
		packs = append(packs, Pack{ID: id, Size: int64(len(b))})
		all = append(all, chunks)
	}
	// The index lists the first and third pack, and one chunk of the
	// second at a place where another frame is.
	stale := all[1][0]
	stale.Pos = all[1][1].Pos
	if _, err := WriteIndex(ctx, st, packs, append(append(slices.Clone(all[0]), stale), all[2]...)); err != nil {
		t.Fatal(err)
	}
	idx, err := Load(ctx, st)
	if err != nil {
		t.Fatal(err)
	}
	sc, err := ScanPacks(ctx, st, present)
	if err != nil {
		t.Fatal(err)
	}
	for i, id := range ids {
		p := sc.Packs[id]
		found := len(all[i])
		if i == 2 {
			found = 1
		}
		if (p.Err != nil) != (i == 2) || p.Size != present[id] || (i == 2 && p.Upto != all[2][1].Pos) {
			t.Fatalf("pack %d: %+v", i, p)
		}
		for k, c := range all[i] {
			if sc.Holds(c.ID, c.Ref) != (k < found) || sc.Unknown(id, c.Pos) != (k >= found) {
				t.Fatalf("pack %d, chunk %d: held %v, unknown %v", i, k, sc.Holds(c.ID, c.Ref), sc.Unknown(id, c.Pos))
			}
		}
	}
	if sc.Holds(stale.ID, stale.Ref) {
		t.Fatalf("the scan holds %+v, a chunk at another's place", stale)
	}
	if n, first, unindexed := sc.Stale(idx); n != 1 || !strings.Contains(first, stale.ID.String()) || unindexed != 1 {
		t.Fatalf("stale %d (%s), unindexed %d; want 1 (%s) and 1", n, first, unindexed, stale.ID)
	}
	name, err := sc.WriteIndex(ctx, st, idx)
	if err != nil {
		t.Fatal(err)
	}
	got, chunks, err := ReadIndex(ctx, st, name)
	if err != nil || len(got) != 3 || len(chunks) != 6 {
		t.Fatalf("rebuilt index: %d packs, %d chunks, %v; want 3 and 6", len(got), len(chunks), err)
	}
	for _, c := range chunks {
		if !sc.Holds(c.ID, c.Ref) && c != all[2][1] {
			t.Fatalf("rebuilt index lists %+v, which the scan does not hold", c)
		}
	}
}

// TestScanHoldsEveryCopy: a chunk two captures stored at once, in two
// packs, is held at both places, and the index rebuilt lists both.
func TestScanHoldsEveryCopy(t *testing.T) {
	ctx := context.Background()
	st := mem.New("loc")
	present := map[PackID]int64{}
	var copies [][]Chunk
	for range 2 {
		id := NewPackID()
		b, chunks := packBytes(id, 7, "same", "content")
		put(t, st, id.Name(), b)
		present[id] = int64(len(b))
		copies = append(copies, chunks)
	}
	sc, err := ScanPacks(ctx, st, present)
	if err != nil {
		t.Fatal(err)
	}
	for _, chunks := range copies {
		for _, c := range chunks {
			if !sc.Holds(c.ID, c.Ref) {
				t.Fatalf("copy %+v not held", c)
			}
		}
	}
	name, err := sc.WriteIndex(ctx, st, NewTable())
	if err != nil {
		t.Fatal(err)
	}
	if _, chunks, err := ReadIndex(ctx, st, name); err != nil || len(chunks) != 4 {
		t.Fatalf("rebuilt index: %d chunks, %v; want both copies of 2", len(chunks), err)
	}
}

// TestCheckChunks: a checkpoint's chunk is checked where a reader finds
// it (the pack the manifest names, else through the index), and what is
// wrong is named by kind: lost, another frame there, only past damage
// (ErrPastDamage), or found only by reading the packs.
func TestCheckChunks(t *testing.T) {
	ctx := context.Background()
	st := mem.New("loc")
	a, b, c, gone := PackID{1}, PackID{2}, PackID{3}, PackID{4}
	present := map[PackID]int64{}
	var packs []Pack
	chunksOf := map[PackID][]Chunk{}
	for i, id := range []PackID{a, b, c} {
		p, chunks := packBytes(id, byte(i), "first", "second")
		if id == b {
			p[chunks[1].Pos+3] ^= 1 // the frames from its second on are unknown
		}
		put(t, st, id.Name(), p)
		present[id] = int64(len(p))
		packs = append(packs, Pack{ID: id, Size: int64(len(p))})
		chunksOf[id] = chunks
	}
	// Pack c's chunks are in no index object.
	if _, err := WriteIndex(ctx, st, packs[:2], append(slices.Clone(chunksOf[a]), chunksOf[b]...)); err != nil {
		t.Fatal(err)
	}
	idx, err := Load(ctx, st)
	if err != nil {
		t.Fatal(err)
	}
	sc, err := ScanPacks(ctx, st, present)
	if err != nil {
		t.Fatal(err)
	}
	// man names chunk ch in pack p (size as listed, or 1 for one gone) at pos.
	man := func(ch Chunk, p PackID, pos int64) *manifest.Manifest {
		size := present[p]
		if size == 0 {
			size = 1
		}
		return &manifest.Manifest{SharedChunks: true, Segments: []manifest.Segment{{Name: p.Name(), Size: size}},
			Files: []manifest.File{{Name: "pages-1.img", Chunks: []manifest.Chunk{{RawLen: ch.RawLen, Stored: ch.Stored,
				Codec: ch.Codec, Checksum: ch.Checksum, Hash: ch.ID, Pos: pos}}}}}
	}
	a0, a1, b1, c0 := chunksOf[a][0], chunksOf[a][1], chunksOf[b][1], chunksOf[c][0]
	for _, tc := range []struct {
		name     string
		m        *manifest.Manifest
		idx      *Table
		sc       *Scan
		want     string // in the error; "" for none
		pastOnly bool
	}{
		{"in place", man(a0, a, a0.Pos), idx, sc, "", false},
		{"repacked, indexed", man(a1, gone, 64), idx, sc, "", false},
		{"another frame there", man(a1, a, a0.Pos), idx, sc, "1 not the frame the manifest names", false},
		{"past the damage", man(b1, b, b1.Pos), idx, sc, "1 past the damage", true},
		{"repacked, past the damage", man(b1, gone, 64), idx, sc, "damaged before offset", true},
		{"unindexed", man(c0, gone, 64), idx, sc, "found only by reading the packs", false},
		{"lost", man(Chunk{ID: manifest.Hash{0xee}, Ref: a0.Ref}, gone, 64), idx, sc, "1 in no pack", false},
		{"no chunk store", man(a0, a, a0.Pos), nil, nil, "1 in no pack", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckChunks(tc.m, tc.idx, tc.sc)
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) || errors.Is(err, ErrPastDamage) != tc.pastOnly {
				t.Fatalf("err %v, want one saying %q (past the damage only: %v)", err, tc.want, tc.pastOnly)
			}
		})
	}
}
