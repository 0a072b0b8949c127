package manifest

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"reflect"
	"testing"
)

// TestChunkJSON: the manifest's own chunk objects take the fast path, and
// everything else is decoded (or refused) as encoding/json does.
func TestChunkJSON(t *testing.T) {
	h := `"00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"`
	for _, c := range []struct {
		name, in string
		fast     bool
	}{
		{"as written", `{"off":4096,"raw":330000,"stored":1234,"codec":2,"crc":4294967295,"hash":` + h + `,"seg":3,"pos":9223372036854775807}`, true},
		{"spaced", ` { "off" : -1 , "raw":1 }`, true},
		{"empty", `{}`, true},
		{"no hash", `{"off":0,"raw":1,"stored":1,"codec":0,"crc":0,"seg":-1,"pos":0}`, true},
		{"unknown key", `{"off":1,"other":2}`, false},
		{"upper-case key", `{"OFF":1}`, false},
		{"escaped key", `{"o\u0066f":1}`, false},
		{"fraction", `{"off":1.0}`, false},
		{"exponent", `{"raw":1e3}`, false},
		{"leading zero", `{"raw":01}`, false},
		{"negative unsigned", `{"raw":-1}`, false},
		{"minus zero unsigned", `{"crc":-0}`, false},
		{"uint32 overflow", `{"stored":4294967296}`, false},
		{"codec overflow", `{"codec":256}`, false},
		{"int64 overflow", `{"pos":9223372036854775808}`, false},
		{"short hash", `{"hash":"0011"}`, false},
		{"bad hex", `{"hash":"zz112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"}`, false},
		{"null", `{"off":null}`, false},
		{"string number", `{"off":"1"}`, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, fast := parseChunk([]byte(c.in), Chunk{})
			if fast != c.fast {
				t.Fatalf("fast path: %v, want %v", fast, c.fast)
			}
			var got, want Chunk
			gotErr := json.Unmarshal([]byte(c.in), &got)
			wantErr := json.Unmarshal([]byte(c.in), (*chunkFields)(&want))
			if (gotErr == nil) != (wantErr == nil) || got != want {
				t.Fatalf("decoded %+v (%v), encoding/json %+v (%v)", got, gotErr, want, wantErr)
			}
		})
	}
}

// FuzzChunkJSON: wherever the fast path takes an object, encoding/json
// decodes it to the same chunk, from a zero chunk and from a filled one.
func FuzzChunkJSON(f *testing.F) {
	f.Add([]byte(`{"off":4096,"raw":330000,"stored":1234,"codec":2,"crc":7,"hash":"00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff","seg":3,"pos":12}`))
	f.Add([]byte(`{"off":-0,"raw":0}`))
	f.Add([]byte(`{ "seg" : -9223372036854775808 }`))
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, start := range []Chunk{{}, {Offset: 5, RawLen: 6, Stored: 7, Codec: 8, Checksum: 9, Hash: Hash{1}, Segment: 10, Pos: 11}} {
			fast, ok := parseChunk(b, start)
			if !ok {
				continue
			}
			want := start
			if err := json.Unmarshal(b, (*chunkFields)(&want)); err != nil {
				t.Fatalf("fast path took %q, encoding/json refuses it: %v", b, err)
			}
			if fast != want {
				t.Fatalf("%q: fast path %+v, encoding/json %+v", b, fast, want)
			}
		}
	})
}

// BenchmarkParseDedupManifest: Parse of the manifest of a deduplicated
// checkpoint the size of e2e/gpu's (42,000 chunks, about 10 MB).
func BenchmarkParseDedupManifest(b *testing.B) {
	doc, err := benchDedupManifest().Marshal()
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(doc)))
	for b.Loop() {
		if _, err := Parse(doc); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkMarshalDedupManifest: Marshal of that manifest, which a
// deduplicated checkpoint's commit writes.
func BenchmarkMarshalDedupManifest(b *testing.B) {
	m := benchDedupManifest()
	doc, err := m.Marshal()
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(doc)))
	for b.Loop() {
		if _, err := m.Marshal(); err != nil {
			b.Fatal(err)
		}
	}
}

// benchDedupManifest is a deduplicated checkpoint's manifest the size of
// e2e/gpu's: 60 files of 700 chunks.
func benchDedupManifest() *Manifest {
	m := &Manifest{Format: VersionSharedChunks, SharedChunks: true, Tool: "bench", ChunkSize: 4 << 20}
	m.Segments = []Segment{{Name: "pack-0", Size: 1 << 40}}
	for f := range 60 {
		fl := File{Name: fmt.Sprintf("vram-1-%02d.bin", f)}
		for i := range 700 {
			c := Chunk{Offset: fl.Size, RawLen: 330000, Stored: 330000, Checksum: uint32(i * 7919), Pos: int64(f*700+i) * 330000}
			binary.LittleEndian.PutUint64(c.Hash[:], uint64(f*700+i)*0x9e3779b97f4a7c15)
			fl.Chunks = append(fl.Chunks, c)
			fl.Size += 330000
		}
		m.Files = append(m.Files, fl)
	}
	return m
}

// FuzzFastDecode: wherever the fast path decodes a document, encoding/json
// decodes it to the same manifest; a real manifest takes the fast path.
func FuzzFastDecode(f *testing.F) {
	m := &Manifest{Format: VersionSharedChunks, SharedChunks: true, Tool: "fuzz", ChunkSize: 1 << 20,
		Segments: []Segment{{Name: "gpucr-chunks/packs/00.pack", Size: 9}},
		Files: []File{{Name: "pages-1.img", ID: 3, Size: 8192, External: true, Chunks: []Chunk{{RawLen: 4096, Stored: 9, Codec: 2, Checksum: 7, Hash: Hash{1}},
			{Offset: 4096, RawLen: 4096, Codec: 1, Segment: -1}}}, {Name: "empty.img", Chunks: []Chunk{}},
			{Name: "descriptors.json", External: true, Carried: true, Chunks: []Chunk{}}}}
	doc, err := m.Marshal()
	if err != nil {
		f.Fatal(err)
	}
	var got Manifest
	if !fastDecode(doc, &got) {
		f.Fatal("a manifest as written does not take the fast path")
	}
	f.Add(doc)
	f.Add([]byte(`{"files":[{"name":"a","chunks":[{"off":1}]}],"format":4}`))
	f.Add([]byte(`{"Files":[],"files":[]}`))
	f.Add([]byte(`{"files":[{"name":"a\u0041"}]}`))
	f.Add([]byte(`{"x":"files","files":[{}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var fast Manifest
		if !fastDecode(b, &fast) {
			return
		}
		var want Manifest
		if err := json.Unmarshal(b, &want); err != nil {
			t.Fatalf("fast path took %q, encoding/json refuses it: %v", b, err)
		}
		if !reflect.DeepEqual(fast, want) {
			t.Fatalf("%q:\nfast path     %+v\nencoding/json %+v", b, fast, want)
		}
	})
}
