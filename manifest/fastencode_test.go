package manifest

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"testing"
)

// sameAsEncodingJSON fails unless marshalIndent writes m exactly as
// json.MarshalIndent does.
func sameAsEncodingJSON(t *testing.T, m *Manifest) {
	t.Helper()
	want, err := json.MarshalIndent(m, "", " ")
	if err != nil {
		t.Fatal(err)
	}
	got, err := marshalIndent(m)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		i := 0
		for i < len(got) && i < len(want) && got[i] == want[i] {
			i++
		}
		t.Fatalf("differs at byte %d of %d (want %d):\ngot  …%q\nwant …%q", i, len(got), len(want), got[max(0, i-40):min(len(got), i+40)], want[max(0, i-40):min(len(want), i+40)])
	}
}

func TestFastEncode(t *testing.T) {
	full := Chunk{Offset: 1 << 40, RawLen: 4 << 20, Stored: 1234, Codec: 3, Checksum: 0xffffffff, Hash: Hash{1, 2, 3}, Segment: -1, Pos: -5}
	for _, tc := range []struct {
		name string
		m    Manifest
	}{
		{"no files", Manifest{Tool: "t"}},
		{"empty files", Manifest{Tool: "t", Files: []File{}}},
		{"every field", Manifest{Format: VersionSharedChunks, SharedChunks: true, Tool: "t", ChunkSize: 1 << 20,
			Segments: []Segment{{Name: "s", Size: 9}},
			Files: []File{
				{Name: "pages-1.img", ID: 7, Size: 8192, Digest: Hash{9}, External: true, Chunks: []Chunk{full, {RawLen: 4096, Codec: 1}}},
				{Name: "empty.img", Chunks: []Chunk{}},
				{Name: "descriptors.json", Size: 3, External: true, Carried: true, Chunks: []Chunk{{RawLen: 3}}},
				{Name: "nil.img"},
			}}},
		{"names encoding/json escapes", Manifest{Files: []File{
			{Name: "<a&b>", Chunks: []Chunk{full}}, {Name: "bad\xff utf8 \u2028\u2029 \"q\" \\ \t\x01"}}}},
	} {
		t.Run(tc.name, func(t *testing.T) { sameAsEncodingJSON(t, &tc.m) })
	}
}

// FuzzFastEncode: manifests built from arbitrary bytes encode as
// encoding/json encodes them.
func FuzzFastEncode(f *testing.F) {
	f.Add([]byte("pages-1.img"), []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33}, uint8(3))
	f.Add([]byte("<>&\xff"), []byte{}, uint8(0))
	f.Fuzz(func(t *testing.T, name, raw []byte, n uint8) {
		m := &Manifest{Tool: string(name), Format: 4}
		for i := range int(n % 5) {
			fl := File{Name: string(name) + string(rune('a'+i)), ID: uint32(i), External: i%2 == 1, Carried: i == 3, Size: int64(len(raw)) - 7}
			if i == 3 {
				fl.Chunks = []Chunk{}
			}
			for k := 0; k+33 <= len(raw); k += 33 {
				c := Chunk{Offset: int64(binary.LittleEndian.Uint64(raw[k:])), RawLen: binary.LittleEndian.Uint32(raw[k+8:]),
					Codec: raw[k+12], Checksum: binary.LittleEndian.Uint32(raw[k+13:]), Segment: int(int8(raw[k+17])), Pos: -int64(raw[k+18])}
				if raw[k+19]%2 == 1 {
					copy(c.Hash[:], raw[k+1:k+33])
				}
				fl.Chunks = append(fl.Chunks, c)
			}
			copy(fl.Digest[:], raw)
			m.Files = append(m.Files, fl)
		}
		sameAsEncodingJSON(t, m)
	})
}
