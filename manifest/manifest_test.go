package manifest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
)

func TestHeaderRoundTrip(t *testing.T) {
	for _, h := range []Header{
		{Version: Version, ShardCount: 1},
		{Version: Version, ShardIndex: 2, ShardCount: 3, StreamID: 0xdeadbeefcafef00d, Flags: 9, LateData: true},
		{Version: VersionSharedChunks, ShardCount: 1, Flags: HeaderFlagLateData}, // the flag means nothing before version 5
		{Version: Version, ShardCount: 1, Flags: HeaderFlagNoChunkHashes | 0xf0, NoChunkHashes: true},
		{Version: VersionEncrypted, ShardIndex: math.MaxUint16 - 1, ShardCount: math.MaxUint16, StreamID: math.MaxUint64, Flags: math.MaxUint32},
	} {
		b := h.Marshal()
		if len(b) != HeaderSize {
			t.Fatalf("Marshal: %d bytes, want %d", len(b), HeaderSize)
		}
		if string(b[:8]) != StreamMagic {
			t.Fatalf("Marshal: magic %q", b[:8])
		}
		got, err := UnmarshalHeader(b)
		if err != nil {
			t.Fatalf("UnmarshalHeader(%+v): %v", h, err)
		}
		if got != h {
			t.Fatalf("round trip: got %+v, want %+v", got, h)
		}
		// Longer input is fine: only the first 32 bytes count.
		if got, err := UnmarshalHeader(append(b, 1, 2, 3)); err != nil || got != h {
			t.Fatalf("with trailing bytes: %+v, %v", got, err)
		}
	}
}

func TestHeaderLayout(t *testing.T) {
	// The byte layout is the format: pin it (docs/FORMAT.md).
	h := Header{Version: 1, Flags: 0x04030201, ShardIndex: 0x0605, ShardCount: 0x0807, StreamID: 0x100f0e0d0c0b0a09}
	b := h.Marshal()
	want := []byte("GPUCRSTM\x01\x00\x20\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f\x10")
	if !bytes.Equal(b[:28], want) {
		t.Fatalf("header bytes\n got % x\nwant % x", b[:28], want)
	}
	if got := binary.LittleEndian.Uint32(b[28:]); got != PayloadChecksum(b[:28]) {
		t.Fatalf("header checksum %08x, want CRC-32C of the first 28 bytes", got)
	}
}

// resum rewrites a header's checksum after a test changed it.
func resumHeader(b []byte) []byte {
	binary.LittleEndian.PutUint32(b[28:], crc(b[:28]))
	return b
}

func TestUnmarshalHeaderErrors(t *testing.T) {
	good := Header{Version: Version, ShardCount: 1, StreamID: 42}.Marshal()
	mod := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	for _, tc := range []struct {
		name string
		in   []byte
		is   error
		want []string
	}{
		{"empty", nil, nil, []string{"0 bytes", "want 32"}},
		{"truncated", good[:31], nil, []string{"31 bytes", "want 32"}},
		{"bad magic", mod(func(b []byte) []byte { b[0] = 'X'; return b }), ErrNotStream, []string{"bad magic", `"XPUCRSTM"`}},
		{"unprintable magic", mod(func(b []byte) []byte { copy(b, "\x00\x01PK\x03\x04\xff\n"); return b }), ErrNotStream, []string{`"..PK...."`}},
		{"newer version", mod(func(b []byte) []byte { b[8] = 6; return resumHeader(b) }), ErrNewerVersion, []string{"version 6", "up to 5", "upgrade"}},
		{"much newer version, stale checksum", mod(func(b []byte) []byte { b[8], b[9] = 0x34, 0x12; return b }), ErrNewerVersion, []string{"version 4660"}},
		{"version zero", mod(func(b []byte) []byte { b[8] = 0; return resumHeader(b) }), nil, []string{"version 0"}},
		{"header length", mod(func(b []byte) []byte { b[10] = 33; return resumHeader(b) }), nil, []string{"length 33", "want 32"}},
		{"checksum", mod(func(b []byte) []byte { b[20] ^= 1; return b }), nil, []string{"checksum mismatch"}},
		{"stored checksum", mod(func(b []byte) []byte { b[31] ^= 0x80; return b }), nil, []string{"checksum mismatch"}},
		{"zero shards", mod(func(b []byte) []byte { b[18] = 0; return resumHeader(b) }), nil, []string{"shard 0 of 0"}},
		{"shard index past count", mod(func(b []byte) []byte { b[16] = 1; return resumHeader(b) }), nil, []string{"shard 1 of 1"}},
		{"encrypted without chunk hashes", mod(func(b []byte) []byte {
			b[12] = HeaderFlagEncrypted | HeaderFlagNoChunkHashes
			return resumHeader(b)
		}), nil, []string{"flags 0x3", "encrypted stream always hashes its chunks"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := UnmarshalHeader(tc.in)
			checkErr(t, err, tc.is, tc.want...)
			if tc.is == nil && errors.Is(err, ErrNewerVersion) {
				t.Errorf("error %q wraps ErrNewerVersion", err)
			}
		})
	}
}

func checkErr(t testing.TB, err, is error, want ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("no error, want one containing %q", want)
	}
	if is != nil && !errors.Is(err, is) {
		t.Errorf("error %q does not wrap %q", err, is)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error %q does not contain %q", err, w)
		}
	}
}

func TestFrameHeaderRoundTrip(t *testing.T) {
	var h [32]byte
	for i := range h {
		h[i] = byte(i*7 + 1)
	}
	for _, fh := range []FrameHeader{
		{Type: FrameFile, FileID: 0, StoredLen: 9, RawLen: 9, Checksum: 0x12345678},
		{Type: FrameFile, Flags: FileFlagExternal, FileID: math.MaxUint32, StoredLen: MaxNameLen},
		{Type: FrameData, Codec: 3, FileID: 7, Offset: 1 << 40, RawLen: MaxPayload, StoredLen: MaxPayload, Checksum: 0xffffffff, Hash: h},
		{Type: FrameData, Codec: 1, FileID: 7, Offset: 1 << 62, RawLen: 4096},
		{Type: FrameFileEnd, FileID: 7, Offset: 12345, RawLen: 3, Hash: h},
		{Type: FrameEnd, StoredLen: 1000, Checksum: 1},
		{Type: FrameEnd},
	} {
		b := make([]byte, FrameSize)
		fh.Marshal(b)
		got, err := UnmarshalFrameHeader(b)
		if err != nil {
			t.Fatalf("UnmarshalFrameHeader(%+v): %v", fh, err)
		}
		if got != fh {
			t.Fatalf("round trip:\n got %+v\nwant %+v", got, fh)
		}
	}
}

func TestFrameHeaderLayout(t *testing.T) {
	fh := FrameHeader{Type: FrameData, Codec: 2, Flags: 0x0403, FileID: 0x08070605, Offset: 0x100f0e0d0c0b0a09,
		RawLen: 0x14131211, StoredLen: 0x100, Checksum: 0x1c1b1a19}
	fh.Offset = 0x0f0e0d0c0b0a09 // within 1<<62
	for i := range fh.Hash {
		fh.Hash[i] = byte(0x20 + i)
	}
	fh.RawLen = 0x01000000
	b := make([]byte, FrameSize)
	fh.Marshal(b)
	want := []byte{2, 2, 3, 4, 5, 6, 7, 8, 9, 0xa, 0xb, 0xc, 0xd, 0xe, 0xf, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0x19, 0x1a, 0x1b, 0x1c}
	if !bytes.Equal(b[:28], want) {
		t.Fatalf("frame header bytes\n got % x\nwant % x", b[:28], want)
	}
	if !bytes.Equal(b[28:60], fh.Hash[:]) {
		t.Fatalf("hash bytes % x", b[28:60])
	}
	if got := binary.LittleEndian.Uint32(b[60:]); got != crc(b[:60]) {
		t.Fatalf("frame header checksum %08x, want CRC-32C of the first 60 bytes", got)
	}
}

func TestUnmarshalFrameHeaderErrors(t *testing.T) {
	enc := func(fh FrameHeader) []byte {
		b := make([]byte, FrameSize)
		fh.Marshal(b)
		return b
	}
	flipped := enc(FrameHeader{Type: FrameData, FileID: 1, RawLen: 10, StoredLen: 10})
	flipped[30] ^= 4
	for _, tc := range []struct {
		name string
		in   []byte
		want []string
	}{
		{"truncated", enc(FrameHeader{Type: FrameEnd})[:63], []string{"63 bytes", "want 64"}},
		{"checksum", flipped, []string{"checksum mismatch"}},
		{"type zero", enc(FrameHeader{Type: 0}), []string{"unknown frame type 0"}},
		{"type 9", enc(FrameHeader{Type: 9, StoredLen: 4}), []string{"unknown frame type 9"}},
		{"payload over limit", enc(FrameHeader{Type: FrameData, FileID: 1, RawLen: 1, StoredLen: MaxPayload + 1}), []string{"DATA frame", "67108865", "exceeds the limit"}},
		{"END payload over limit", enc(FrameHeader{Type: FrameEnd, StoredLen: math.MaxUint32}), []string{"END frame", "4294967295", "exceeds the limit"}},
		{"raw over limit", enc(FrameHeader{Type: FrameData, FileID: 1, RawLen: MaxPayload + 1, StoredLen: 1}), []string{"raw length 67108865", "exceeds the limit"}},
		{"data offset", enc(FrameHeader{Type: FrameData, FileID: 1, RawLen: 1, Offset: 1<<62 + 1}), []string{"offset 4611686018427387905 out of range"}},
		{"empty name", enc(FrameHeader{Type: FrameFile}), []string{"name length 0"}},
		{"long name", enc(FrameHeader{Type: FrameFile, StoredLen: MaxNameLen + 1}), []string{"name length 4097"}},
		{"file-end payload", enc(FrameHeader{Type: FrameFileEnd, StoredLen: 1}), []string{"FILE-END", "unexpected payload of 1 bytes"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := UnmarshalFrameHeader(tc.in)
			checkErr(t, err, nil, tc.want...)
		})
	}
}

func TestFrameTypeString(t *testing.T) {
	for ft, want := range map[FrameType]string{FrameFile: "FILE", FrameData: "DATA", FrameFileEnd: "FILE-END", FrameEnd: "END", 0: "frame-type(0)", 200: "frame-type(200)"} {
		if got := ft.String(); got != want {
			t.Errorf("FrameType(%d).String() = %q, want %q", uint8(ft), got, want)
		}
	}
}

func TestTail(t *testing.T) {
	b := MarshalTail(0x0102030405060708)
	if len(b) != TailSize || string(b[8:]) != TailMagic {
		t.Fatalf("MarshalTail = % x", b)
	}
	off, err := UnmarshalTail(b)
	if err != nil || off != 0x0102030405060708 {
		t.Fatalf("UnmarshalTail = %d, %v", off, err)
	}
	for _, bad := range [][]byte{nil, b[:15], append(bytes.Clone(b), 0), append(bytes.Clone(b[:15]), 'Y')} {
		if _, err := UnmarshalTail(bad); err == nil || !strings.Contains(err.Error(), "tail missing") {
			t.Errorf("UnmarshalTail(% x) = %v, want a tail-missing error", bad, err)
		}
	}
}

// testStream is a valid stream and where its frames are.
type testStream struct {
	b      []byte
	frames []Frame // with Pos
	end    int64   // offset of the END frame
	names  []string
	data   map[string][]byte // file name -> concatenated DATA payloads
}

// frameSpec is one frame a test writes through Writer.
type frameSpec struct {
	fh      FrameHeader
	payload []byte
}

func file(id uint32, name string) frameSpec {
	return frameSpec{FrameHeader{Type: FrameFile, FileID: id}, []byte(name)}
}

func data(id uint32, off uint64, payload []byte) frameSpec {
	return frameSpec{FrameHeader{Type: FrameData, FileID: id, Offset: off, RawLen: uint32(len(payload)), Checksum: crc(payload), Codec: 0}, payload}
}

func fileEnd(id uint32, size uint64, chunks uint32) frameSpec {
	return frameSpec{FrameHeader{Type: FrameFileEnd, FileID: id, Offset: size, RawLen: chunks}, nil}
}

// writeStream writes frames with Writer, then the END frame with trailer.
func writeStream(t testing.TB, h Header, frames []frameSpec, trailer []byte) testStream {
	t.Helper()
	var buf bytes.Buffer
	w, err := NewWriter(&buf, h)
	if err != nil {
		t.Fatal(err)
	}
	ts := testStream{data: map[string][]byte{}}
	names := map[uint32]string{}
	for _, f := range frames {
		fh := f.fh
		if want := w.Pos(); want != int64(HeaderSize)+int64(sumLen(ts.frames)) {
			t.Fatalf("Pos %d, want %d", w.Pos(), want)
		}
		pos, err := w.WriteFrame(&fh, f.payload)
		if err != nil {
			t.Fatal(err)
		}
		ts.frames = append(ts.frames, Frame{FrameHeader: fh, Payload: f.payload, Pos: pos})
		switch fh.Type {
		case FrameFile:
			names[fh.FileID] = string(f.payload)
			ts.names = append(ts.names, string(f.payload))
		case FrameData:
			n := names[fh.FileID]
			ts.data[n] = append(ts.data[n], f.payload...)
		}
	}
	ts.end = w.Pos()
	if err := w.Finish(trailer); err != nil {
		t.Fatal(err)
	}
	if got, want := w.Pos(), ts.end+FrameSize+int64(len(trailer))+TailSize; got != want {
		t.Fatalf("Pos after Finish %d, want %d", got, want)
	}
	ts.frames = append(ts.frames, Frame{FrameHeader: FrameHeader{Type: FrameEnd, StoredLen: uint32(len(trailer)), Checksum: crc(trailer)}, Payload: trailer, Pos: ts.end})
	ts.b = buf.Bytes()
	if int64(len(ts.b)) != w.Pos() {
		t.Fatalf("wrote %d bytes, Pos says %d", len(ts.b), w.Pos())
	}
	return ts
}

func sumLen(frames []Frame) int {
	n := 0
	for _, f := range frames {
		n += FrameSize + len(f.Payload)
	}
	return n
}

func sampleFrames() []frameSpec {
	big := bytes.Repeat([]byte("0123456789abcdef"), 20000) // 320000 bytes, larger than Writer's buffer
	return []frameSpec{
		file(0, "inventory.img"),
		data(0, 0, []byte("inventory bytes")),
		file(1, "pages-1.img"),
		data(1, 0, big),
		fileEnd(0, 15, 1),
		data(1, uint64(len(big)), []byte{0, 1, 2, 255}),
		fileEnd(1, uint64(len(big)+4), 2),
		file(2, "empty.img"),
		fileEnd(2, 0, 0),
	}
}

// readAll runs the Reader over b and returns the frames and the first error.
func readAll(b []byte, name string) (*Reader, []Frame, error) {
	rd, err := NewReader(bytes.NewReader(b), name)
	if err != nil {
		return nil, nil, err
	}
	var out []Frame
	for {
		f, err := rd.Next(nil)
		if err == io.EOF {
			return rd, out, nil
		}
		if err != nil {
			return rd, out, err
		}
		out = append(out, f)
	}
}

func TestReaderRoundTrip(t *testing.T) {
	trailer := []byte(`{"format":1}`)
	for _, h := range []Header{{ShardCount: 1, StreamID: 9}, {ShardIndex: 1, ShardCount: 2, StreamID: 10}} {
		ts := writeStream(t, h, sampleFrames(), trailer)
		rd, frames, err := readAll(ts.b, "test")
		if err != nil {
			t.Fatal(err)
		}
		wantH := h
		wantH.Version = VersionPlain
		if rd.Header() != wantH {
			t.Fatalf("Header() = %+v, want %+v", rd.Header(), wantH)
		}
		if len(frames) != len(ts.frames) {
			t.Fatalf("%d frames, want %d", len(frames), len(ts.frames))
		}
		for i, f := range frames {
			w := ts.frames[i]
			if f.FrameHeader != w.FrameHeader || f.Pos != w.Pos || !bytes.Equal(f.Payload, w.Payload) {
				t.Fatalf("frame %d:\n got %+v at %d (%d bytes)\nwant %+v at %d (%d bytes)", i, f.FrameHeader, f.Pos, len(f.Payload), w.FrameHeader, w.Pos, len(w.Payload))
			}
		}
		if rd.Pos() != int64(len(ts.b)) {
			t.Fatalf("Pos() = %d after the stream, want %d", rd.Pos(), len(ts.b))
		}
		names := []string{"inventory.img", "pages-1.img", "empty.img"}
		for _, f := range frames {
			if f.Type != FrameEnd && f.Name != names[f.FileID] {
				t.Errorf("%s frame of file %d: Name %q, want %q", f.Type, f.FileID, f.Name, names[f.FileID])
			}
		}
		// Every file ended: none is held any more.
		for id := range names {
			if got := rd.FileName(uint32(id)); got != "" {
				t.Errorf("FileName(%d) = %q after its FILE-END", id, got)
			}
		}
		if got := rd.FileName(99); got != "" {
			t.Errorf("FileName(99) = %q", got)
		}
		// EOF is sticky.
		for range 3 {
			if _, err := rd.Next(nil); err != io.EOF {
				t.Fatalf("Next after END = %v, want io.EOF", err)
			}
		}
		// The tail points at the END frame.
		off, err := UnmarshalTail(ts.b[len(ts.b)-TailSize:])
		if err != nil || int64(off) != ts.end {
			t.Fatalf("tail = %d, %v; END frame at %d", off, err, ts.end)
		}
	}
}

func TestReaderAlloc(t *testing.T) {
	ts := writeStream(t, Header{}, sampleFrames(), nil)
	rd, err := NewReader(bytes.NewReader(ts.b), "alloc")
	if err != nil {
		t.Fatal(err)
	}
	var asked []int
	backing := make([]byte, 1<<20)
	for {
		f, err := rd.Next(func(fh FrameHeader) ([]byte, error) { asked = append(asked, int(fh.StoredLen)); return backing, nil })
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if f.Type == FrameData && (len(f.Payload) != int(f.StoredLen) || &f.Payload[0] != &backing[0]) {
			t.Fatalf("DATA payload not in the allocated buffer")
		}
		if f.Type == FrameFile && len(f.Payload) > 0 && &f.Payload[0] == &backing[0] {
			t.Fatalf("FILE payload in the DATA buffer")
		}
	}
	// alloc is for DATA payloads only.
	if want := []int{15, 320000, 4}; fmt.Sprint(asked) != fmt.Sprint(want) {
		t.Fatalf("alloc called with %v, want %v", asked, want)
	}
}

// lendingReader holds the stream in memory and gives payloads of at least
// min bytes as they are (a chunk cache's REF payloads).
type lendingReader struct {
	*bytes.Reader
	b   []byte
	min int
}

func (h *lendingReader) LendPayload(n int) []byte {
	pos := len(h.b) - h.Len()
	if n < h.min || pos+n > len(h.b) {
		return nil
	}
	h.Seek(int64(n), io.SeekCurrent)
	return h.b[pos : pos+n]
}

func TestReaderBorrowPayloads(t *testing.T) {
	ts := writeStream(t, Header{}, sampleFrames(), nil)
	for _, use := range []bool{false, true} {
		hr := &lendingReader{Reader: bytes.NewReader(ts.b), b: ts.b, min: 1000}
		rd, err := NewReader(hr, "lending")
		if err != nil {
			t.Fatal(err)
		}
		if use {
			rd.BorrowPayloads()
		}
		var asked []int
		for i := 0; ; i++ {
			f, err := rd.Next(func(fh FrameHeader) ([]byte, error) {
				asked = append(asked, int(fh.StoredLen))
				return make([]byte, fh.StoredLen), nil
			})
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			if w := ts.frames[i]; f.FrameHeader != w.FrameHeader || !bytes.Equal(f.Payload, w.Payload) {
				t.Fatalf("BorrowPayloads %v: frame %d differs", use, i)
			}
			borrowed := use && f.Type == FrameData && f.StoredLen >= 1000
			if f.Borrowed != borrowed || borrowed && &f.Payload[0] != &ts.b[f.Pos+FrameSize] {
				t.Fatalf("BorrowPayloads %v: %s frame of %d bytes: Borrowed %v, in the reader's memory %v", use, f.Type, f.StoredLen, f.Borrowed, &f.Payload[0] == &ts.b[f.Pos+FrameSize])
			}
		}
		want := []int{15, 320000, 4}
		if use {
			want = []int{15, 4}
		}
		if fmt.Sprint(asked) != fmt.Sprint(want) {
			t.Fatalf("BorrowPayloads %v: alloc called with %v, want %v", use, asked, want)
		}
	}
}

func TestReaderEmptyStream(t *testing.T) {
	ts := writeStream(t, Header{}, nil, nil)
	if len(ts.b) != HeaderSize+FrameSize+TailSize {
		t.Fatalf("empty stream is %d bytes", len(ts.b))
	}
	_, frames, err := readAll(ts.b, "empty")
	if err != nil || len(frames) != 1 || frames[0].Type != FrameEnd || frames[0].Pos != HeaderSize {
		t.Fatalf("frames %+v, err %v", frames, err)
	}
}

// rawFrame encodes a frame header as given (no validation) plus payload.
func rawFrame(fh FrameHeader, payload []byte) []byte {
	b := make([]byte, FrameSize, FrameSize+len(payload))
	fh.Marshal(b)
	return append(b, payload...)
}

func TestReaderErrors(t *testing.T) {
	ts := writeStream(t, Header{StreamID: 5}, sampleFrames(), []byte(`{"trailer":true}`))
	hdr := ts.b[:HeaderSize]
	fr := ts.frames
	// Offsets of interesting frames in ts.
	var firstData, bigData, fileEnd0, emptyFile Frame = fr[1], fr[3], fr[4], fr[7]
	end := fr[len(fr)-1]
	if firstData.Type != FrameData || bigData.StoredLen != 320000 || fileEnd0.Type != FrameFileEnd || emptyFile.Type != FrameFile || end.Type != FrameEnd {
		t.Fatal("sampleFrames changed; fix the offsets")
	}
	at := func(off int64) string { return fmt.Sprintf("at offset %d", off) }
	cut := func(n int64) []byte { return bytes.Clone(ts.b[:n]) }
	flip := func(off int64, mask byte) []byte {
		b := bytes.Clone(ts.b)
		b[off] ^= mask
		return b
	}
	// replace puts raw bytes in place of the frame at pos (same length).
	replace := func(pos int64, raw []byte) []byte {
		b := bytes.Clone(ts.b)
		copy(b[pos:], raw)
		return b
	}
	// prefix is header + the given frames, built by hand.
	prefix := func(frames ...[]byte) []byte {
		b := bytes.Clone(hdr)
		for _, f := range frames {
			b = append(b, f...)
		}
		return b
	}
	endFrame := func(pos int64) []byte {
		return append(rawFrame(FrameHeader{Type: FrameEnd, Checksum: crc(nil)}, nil), MarshalTail(uint64(pos))...)
	}
	tailPos := int64(len(ts.b) - TailSize)
	newer := bytes.Clone(ts.b)
	newer[8] = 7
	resumHeader(newer)

	for _, tc := range []struct {
		name string
		in   []byte
		is   error
		want []string
	}{
		{"empty input", nil, nil, []string{"empty input"}},
		{"truncated header", cut(20), io.ErrUnexpectedEOF, []string{"stream header", at(0)}},
		{"bad magic", replace(0, []byte("GPUCRSTX")), ErrNotStream, []string{at(0), "bad magic"}},
		{"tail magic first", replace(0, []byte(TailMagic)), ErrNotStream, []string{at(0)}},
		{"newer version", newer, ErrNewerVersion, []string{at(0), "version 7", "up to 5"}},
		{"header checksum", flip(24, 0x10), errdefs.ErrCorrupt, []string{at(0), "checksum mismatch"}},
		{"frame header checksum", flip(firstData.Pos+9, 1), errdefs.ErrCorrupt, []string{at(firstData.Pos), "frame header checksum mismatch"}},
		{"frame stored checksum", flip(bigData.Pos+63, 1), errdefs.ErrCorrupt, []string{at(bigData.Pos), "frame header checksum mismatch"}},
		{"bad frame type", replace(fileEnd0.Pos, rawFrame(FrameHeader{Type: 7, FileID: 0}, nil)), errdefs.ErrCorrupt, []string{at(fileEnd0.Pos), "unknown frame type 7"}},
		{"over-long payload", prefix(rawFrame(FrameHeader{Type: FrameEnd, StoredLen: MaxPayload + 1}, nil)), errdefs.ErrCorrupt, []string{at(HeaderSize), "exceeds the limit"}},
		{"over-long data payload", replace(fileEnd0.Pos, rawFrame(FrameHeader{Type: FrameData, FileID: 0, RawLen: 1, StoredLen: 1 << 31}, nil)), errdefs.ErrCorrupt, []string{at(fileEnd0.Pos), "(file inventory.img)", "2147483648", "exceeds the limit"}},
		{"over-long raw length", replace(fileEnd0.Pos, rawFrame(FrameHeader{Type: FrameData, FileID: 0, RawLen: MaxPayload + 1}, nil)), errdefs.ErrCorrupt, []string{at(fileEnd0.Pos), "raw length"}},
		{"over-long name", prefix(rawFrame(FrameHeader{Type: FrameFile, StoredLen: MaxNameLen + 1}, nil)), errdefs.ErrCorrupt, []string{at(HeaderSize), "name length"}},
		{"FILE-END with payload", replace(fileEnd0.Pos, rawFrame(FrameHeader{Type: FrameFileEnd, FileID: 0, StoredLen: 8}, nil)), errdefs.ErrCorrupt, []string{at(fileEnd0.Pos), "unexpected payload"}},
		{"DATA for unopened file", prefix(rawFrame(FrameHeader{Type: FrameData, FileID: 3, RawLen: 2, StoredLen: 2, Checksum: crc([]byte("hi"))}, []byte("hi"))), errdefs.ErrCorrupt, []string{at(HeaderSize), "file id 3", "never opened"}},
		{"DATA for file id opened later", replace(firstData.Pos, rawFrame(FrameHeader{Type: FrameData, FileID: 1, RawLen: 15, StoredLen: 15}, nil)), errdefs.ErrCorrupt, []string{at(firstData.Pos), "file id 1", "never opened"}},
		{"FILE-END for unopened file", prefix(rawFrame(FrameHeader{Type: FrameFileEnd, FileID: 1}, nil)), errdefs.ErrCorrupt, []string{at(HeaderSize), "FILE-END frame for file id 1", "never opened"}},
		{"truncated frame header", cut(bigData.Pos + 10), io.ErrUnexpectedEOF, []string{at(bigData.Pos), "reading frame"}},
		{"truncated payload", cut(bigData.Pos + FrameSize + 1000), errdefs.ErrCorrupt, []string{at(bigData.Pos), "(file pages-1.img)", "payload of 320000 bytes truncated"}},
		{"truncated payload, no byte", cut(bigData.Pos + FrameSize), errdefs.ErrCorrupt, []string{at(bigData.Pos), "truncated"}},
		{"truncated FILE name", cut(emptyFile.Pos + FrameSize + 3), errdefs.ErrCorrupt, []string{at(emptyFile.Pos), "FILE frame payload of 9 bytes truncated"}},
		{"FILE payload checksum", flip(emptyFile.Pos+FrameSize+2, 0x20), errdefs.ErrCorrupt, []string{at(emptyFile.Pos), "FILE frame payload checksum mismatch"}},
		{"END payload checksum", flip(end.Pos+FrameSize+3, 1), errdefs.ErrCorrupt, []string{at(end.Pos), "END frame payload checksum mismatch"}},
		{"END frame checksum", flip(end.Pos+24, 1), errdefs.ErrCorrupt, []string{at(end.Pos), "checksum mismatch"}},
		{"no END frame", cut(end.Pos), errdefs.ErrCorrupt, []string{fmt.Sprintf("truncated at offset %d", end.Pos), "no END frame"}},
		{"only a header", cut(HeaderSize), errdefs.ErrCorrupt, []string{"truncated at offset 32", "no END frame"}},
		{"no tail", cut(tailPos), errdefs.ErrCorrupt, []string{"truncated after END frame", at(end.Pos)}},
		{"half a tail", cut(tailPos + 8), errdefs.ErrCorrupt, []string{"truncated after END frame", at(end.Pos)}},
		{"bad tail magic", flip(int64(len(ts.b)-1), 1), errdefs.ErrCorrupt, []string{"bad stream tail", at(tailPos)}},
		{"tail offset wrong", flip(tailPos, 1), errdefs.ErrCorrupt, []string{"bad stream tail", at(tailPos)}},
		{"END right after header, tail wrong", prefix(endFrame(0)), errdefs.ErrCorrupt, []string{"bad stream tail", at(HeaderSize + FrameSize)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := readAll(tc.in, "shard 1")
			checkErr(t, err, tc.is, append(tc.want, "shard 1")...)
		})
	}
	// Sanity: the hand-built END frame is accepted where it belongs.
	if _, frames, err := readAll(prefix(endFrame(HeaderSize)), "ok"); err != nil || len(frames) != 1 {
		t.Fatalf("hand-built END frame: %v", err)
	}
}

// Every single-byte change to the structure of a stream is caught: headers,
// FILE and END payloads and the tail (DATA payloads are checked after
// decoding, by the caller).
func TestReaderDetectsEveryFlip(t *testing.T) {
	ts := writeStream(t, Header{StreamID: 77}, []frameSpec{
		file(0, "a.img"), data(0, 0, []byte("abc")), fileEnd(0, 3, 1),
		file(1, "b.img"), data(1, 0, []byte("defg")), fileEnd(1, 4, 1),
	}, []byte(`{"x":1}`))
	dataBytes := map[int64]bool{}
	for _, f := range ts.frames {
		if f.Type == FrameData {
			for i := range int64(f.StoredLen) {
				dataBytes[f.Pos+FrameSize+i] = true
			}
		}
	}
	for off := range int64(len(ts.b)) {
		if dataBytes[off] {
			continue
		}
		for _, mask := range []byte{0x01, 0x80, 0xff} {
			b := bytes.Clone(ts.b)
			b[off] ^= mask
			if _, _, err := readAll(b, "x"); err == nil {
				t.Fatalf("flipping byte %d with %02x went unnoticed", off, mask)
			}
		}
	}
}

// Any prefix of a stream is an error, never a clean end.
func TestReaderEveryTruncation(t *testing.T) {
	ts := writeStream(t, Header{}, []frameSpec{file(0, "a.img"), data(0, 0, []byte("abcdef")), fileEnd(0, 6, 1)}, []byte("{}"))
	for n := range len(ts.b) {
		if _, _, err := readAll(ts.b[:n], "cut"); err == nil {
			t.Fatalf("stream cut at %d of %d bytes read cleanly", n, len(ts.b))
		} else if n > 0 && !strings.Contains(err.Error(), "offset") {
			t.Errorf("cut at %d: error %q names no offset", n, err)
		}
	}
	// Bytes after the tail are not read.
	if _, _, err := readAll(append(bytes.Clone(ts.b), "garbage"...), "extra"); err != nil {
		t.Fatal(err)
	}
}

// A reader error mid-stream is passed through with the offset.
func TestReaderIOError(t *testing.T) {
	ts := writeStream(t, Header{}, sampleFrames(), nil)
	boom := errors.New("boom")
	at := ts.frames[3].Pos + FrameSize + 10
	rd, err := NewReader(io.MultiReader(bytes.NewReader(ts.b[:at]), errReader{boom}), "pipe")
	if err != nil {
		t.Fatal(err)
	}
	for {
		_, err = rd.Next(nil)
		if err != nil {
			break
		}
	}
	checkErr(t, err, nil, "pipe", fmt.Sprintf("at offset %d", ts.frames[3].Pos), "boom")
	// Header read error.
	_, err = NewReader(errReader{boom}, "hdr")
	checkErr(t, err, boom, "hdr", "offset 0")
}

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

func TestWriterErrors(t *testing.T) {
	boom := errors.New("disk full")
	// The header is buffered; a failing writer shows at the first flush.
	w, err := NewWriter(failWriter{boom}, Header{})
	if err != nil {
		t.Fatal(err)
	}
	big := make([]byte, 1<<20)
	_, err = w.WriteFrame(&FrameHeader{Type: FrameData, RawLen: 1 << 20}, big)
	checkErr(t, err, boom, "offset 32")
	if err := w.Finish(nil); !errors.Is(err, boom) {
		t.Fatalf("Finish after failure = %v", err)
	}
}

type failWriter struct{ err error }

func (f failWriter) Write([]byte) (int, error) { return 0, f.err }

func TestWriterFillsChecksums(t *testing.T) {
	var buf bytes.Buffer
	w, _ := NewWriter(&buf, Header{ShardCount: 0})
	fh := FrameHeader{Type: FrameFile, Checksum: 123, StoredLen: 999}
	if _, err := w.WriteFrame(&fh, []byte("n")); err != nil {
		t.Fatal(err)
	}
	if fh.StoredLen != 1 || fh.Checksum != crc([]byte("n")) {
		t.Fatalf("WriteFrame left %+v", fh)
	}
	// DATA frames keep the caller's raw checksum.
	dh := FrameHeader{Type: FrameData, Checksum: 123, RawLen: 5}
	if _, err := w.WriteFrame(&dh, []byte("xy")); err != nil {
		t.Fatal(err)
	}
	if dh.Checksum != 123 || dh.StoredLen != 2 {
		t.Fatalf("DATA frame header changed: %+v", dh)
	}
	_ = w.Flush()
	h, err := UnmarshalHeader(buf.Bytes())
	if err != nil || h.ShardCount != 1 || h.Version != VersionPlain {
		t.Fatalf("NewWriter with ShardCount 0 wrote %+v, %v", h, err)
	}
}

// ---- manifest document ----

func hashOf(b byte) Hash {
	var h Hash
	for i := range h {
		h[i] = b + byte(i)
	}
	return h
}

func goodManifest() *Manifest {
	m := &Manifest{
		Format:    Version,
		ID:        "ckpt-1",
		Created:   time.Date(2025, 3, 4, 5, 6, 7, 8, time.UTC),
		Tool:      "gpucr-stream test",
		Codec:     "auto",
		ChunkSize: 1 << 20,
		Labels:    map[string]string{"job": "train"},
		GPUs:      []GPU{{UUID: "GPU-1", Name: "H100", Bytes: 1 << 30}},
		Segments:  []Segment{{Name: SegmentName(7, 0), Size: 4000}, {Name: SegmentName(7, 1), Size: 2000}},
		Files: []File{
			{Name: "pages-1.img", Size: 3000, Digest: hashOf(1), Chunks: []Chunk{
				{Offset: 0, RawLen: 1000, Stored: 500, Codec: 3, Checksum: 1, Hash: hashOf(2), Segment: 0, Pos: 32},
				{Offset: 1000, RawLen: 1000, Stored: 0, Codec: 1, Segment: 0, Pos: 600},
				{Offset: 2000, RawLen: 1000, Stored: 1000, Codec: 0, Segment: 1, Pos: 100},
			}},
			{Name: "empty.img", Size: 0, Chunks: []Chunk{}},
			{Name: "ext", External: true, Size: 10, Chunks: []Chunk{{RawLen: 10, Stored: 10, Segment: 1, Pos: 2000 - 74}}},
		},
	}
	m.Stats.Add("zstd", 1000, 500)
	m.Stats.Add("zero", 1000, 0)
	m.Stats.Add("none", 1010, 1010)
	return m
}

// A manifest without chunk hashes is format 3 and leaves the chunks'
// hashes out; a format 1 reader refuses it as newer.
func TestManifestNoChunkHashes(t *testing.T) {
	m := goodManifest()
	m.NoChunkHashes = true
	m.Files[0].Chunks[0].Hash = Hash{}
	b, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	got, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	if got.Format != VersionNoChunkHashes || !got.NoChunkHashes {
		t.Fatalf("format %d, no_chunk_hashes %v", got.Format, got.NoChunkHashes)
	}
	if bytes.Contains(b, []byte(`"hash"`)) || !bytes.Contains(b, []byte(`"no_chunk_hashes": true`)) {
		t.Fatalf("document:\n%s", b)
	}
	m.NoChunkHashes = false
	if b, _ := m.Marshal(); !bytes.Contains(b, []byte(`"format": 1`)) {
		t.Fatalf("with chunk hashes, not format 1:\n%s", b)
	}
}

func TestManifestRoundTrip(t *testing.T) {
	m := goodManifest()
	if err := m.Validate(); err != nil {
		t.Fatal(err)
	}
	b, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	got, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	b2, _ := got.Marshal()
	if !bytes.Equal(b, b2) {
		t.Fatalf("round trip changed the document:\n%s\n%s", b, b2)
	}
	if !got.Created.Equal(m.Created) || got.Files[0].Chunks[0].Hash != hashOf(2) || got.Files[0].Digest != hashOf(1) {
		t.Fatalf("fields lost: %+v", got.Files[0])
	}
	// Hashes are hex in JSON.
	if !bytes.Contains(b, []byte(`"digest": "`+hashOf(1).String()+`"`)) {
		t.Fatalf("digest not written as hex:\n%s", b)
	}
	if f, ok := got.Lookup("ext"); !ok || !f.External || f.Size != 10 {
		t.Fatalf("Lookup(ext) = %+v, %v", f, ok)
	}
	if _, ok := got.Lookup("nope"); ok {
		t.Fatal("Lookup of a missing file succeeded")
	}
	s := got.Stats
	if s.Chunks != 3 || s.RawBytes != 3010 || s.StoredBytes != 1510 || s.ByCodec["zstd"].StoredBytes != 500 || s.ByCodec["zero"].Chunks != 1 {
		t.Fatalf("stats %+v", s)
	}
	if r := s.Ratio(); math.Abs(r-3010.0/1510) > 1e-9 {
		t.Fatalf("Ratio = %v", r)
	}
	if r := (Stats{}).Ratio(); r != 1 {
		t.Fatalf("empty Ratio = %v", r)
	}
	if got := SegmentName(0x1234abcd, 12); got != "segments/000000001234abcd-00000012.gcs" {
		t.Fatalf("SegmentName(0x1234abcd, 12) = %q", got)
	}
}

// seal appends a valid checksum to a hand-written document, so that Parse
// gets past the checksum to the check under test.
func seal(b []byte) []byte {
	b = append(bytes.TrimSuffix(b, []byte("}")), []byte(`, `+checksumKey)...)
	return append(b, []byte(fmt.Sprintf("%08x\"}", crc(b)))...)
}

func TestParseErrors(t *testing.T) {
	mutate := func(f func(m *Manifest)) []byte {
		m := goodManifest()
		f(m)
		b, err := m.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	pages := func(m *Manifest) *File { return &m.Files[0] }
	for _, tc := range []struct {
		name string
		in   []byte
		is   error
		want []string
	}{
		{"not JSON", []byte("{"), nil, []string{"not valid JSON"}},
		{"unsealed", []byte(`{"format":1,"files":[]}`), nil, []string{"no checksum"}},
		{"flipped byte in a name", func() []byte {
			b, _ := goodManifest().Marshal()
			i := bytes.Index(b, []byte("pages-1.img"))
			b[i] = 'q'
			return b
		}(), nil, []string{"checksum mismatch"}},
		{"empty", nil, nil, []string{"not valid JSON"}},
		{"array", []byte("[]"), nil, []string{"not valid JSON"}},
		{"no format", []byte(`{"files":[]}`), nil, []string{"format 0"}},
		{"newer format", []byte(`{"format":5,"files":[{"name":"x","future_field":{}}]}`), ErrNewerVersion, []string{"format 5", "up to 4"}},
		{"newer format, unknown shape", []byte(`{"format":99,"files":"a string now"}`), ErrNewerVersion, []string{"format 99"}},
		{"format not a number", []byte(`{"format":"1"}`), nil, []string{"not valid JSON"}},
		{"no chunk hashes in format 1", seal([]byte(`{"format":1,"no_chunk_hashes":true,"files":[]}`)), nil, []string{"no_chunk_hashes in a format 1 manifest"}},
		{"no chunk hashes, encrypted", seal([]byte(`{"format":3,"encryption":{"cipher":1},"no_chunk_hashes":true,"files":[]}`)), nil, []string{"no_chunk_hashes in a format 3 manifest (encrypted: true)"}},
		{"wrong field type", seal([]byte(`{"format":1,"files":[{"name":1}]}`)), nil, []string{"manifest:"}},
		{"bad hash", seal([]byte(`{"format":1,"files":[{"name":"a","digest":"zz"}]}`)), nil, []string{"hash", "64 hex digits"}},
		{"bad hash hex", seal([]byte(`{"format":1,"files":[{"name":"a","digest":"` + strings.Repeat("g", 64) + `"}]}`)), nil, []string{"invalid byte"}},
		{"gap", mutate(func(m *Manifest) { pages(m).Chunks[1].Offset = 1001 }), nil, []string{"pages-1.img chunk 1 at offset 1001, want 1000"}},
		{"overlap", mutate(func(m *Manifest) { pages(m).Chunks[2].Offset = 1500 }), nil, []string{"pages-1.img chunk 2 at offset 1500, want 2000"}},
		{"first chunk not at 0", mutate(func(m *Manifest) { m.Files[2].Chunks[0].Offset = 1 }), nil, []string{"ext chunk 0 at offset 1, want 0"}},
		{"size too large", mutate(func(m *Manifest) { pages(m).Size = 3001 }), nil, []string{"pages-1.img has 3000 bytes in chunks, size says 3001"}},
		{"size too small", mutate(func(m *Manifest) { pages(m).Size = 2000 }), nil, []string{"size says 2000"}},
		{"empty file with size", mutate(func(m *Manifest) { m.Files[1].Size = 5 }), nil, []string{"empty.img has 0 bytes in chunks, size says 5"}},
		{"zero-length chunk", mutate(func(m *Manifest) { pages(m).Chunks[1].RawLen = 0 }), nil, []string{"chunk 1 has impossible length"}},
		{"huge chunk", mutate(func(m *Manifest) { pages(m).Chunks[0].RawLen = MaxPayload + 1 }), nil, []string{"chunk 0 has impossible length"}},
		{"huge stored", mutate(func(m *Manifest) { pages(m).Chunks[0].Stored = MaxPayload + 1 }), nil, []string{"impossible length"}},
		{"segment out of range", mutate(func(m *Manifest) { pages(m).Chunks[2].Segment = 2 }), nil, []string{"chunk 2 names segment 2 of 2"}},
		{"negative segment", mutate(func(m *Manifest) { pages(m).Chunks[0].Segment = -1 }), nil, []string{"names segment -1"}},
		{"chunk past segment end", mutate(func(m *Manifest) { m.Files[2].Chunks[0].Pos++ }), nil, []string{"ext chunk 0 lies outside its segment"}},
		{"negative pos", mutate(func(m *Manifest) { pages(m).Chunks[0].Pos = -1 }), nil, []string{"lies outside its segment"}},
		{"duplicate names", mutate(func(m *Manifest) {
			m.Files[1].Name = "pages-1.img"
			m.Files[1].Chunks = pages(m).Chunks
			m.Files[1].Size = 3000
		}), nil, []string{"pages-1.img listed twice"}},
		{"empty name", mutate(func(m *Manifest) { m.Files[1].Name = "" }), nil, []string{"empty or over-long name"}},
		{"long name", mutate(func(m *Manifest) { m.Files[1].Name = strings.Repeat("n", MaxNameLen+1) }), nil, []string{"empty or over-long name"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := Parse(tc.in)
			if m != nil {
				t.Errorf("Parse returned a manifest with error %v", err)
			}
			checkErr(t, err, tc.is, append(tc.want, "manifest")...)
			if tc.is == nil && !errors.Is(err, errdefs.ErrCorrupt) {
				if tc.name == "no format" {
				}
				if strings.Contains(tc.name, "wrong field type") || strings.Contains(tc.name, "bad hash") {
				}
				t.Errorf("error %q does not wrap errdefs.ErrCorrupt", err)
			}
		})
	}
}

func TestValidateWithoutSegments(t *testing.T) {
	// A stream's trailer has no segments: positions are per shard and not
	// checked against sizes.
	m := goodManifest()
	m.Segments = nil
	m.Files[0].Chunks[2].Segment = 5
	m.Files[0].Chunks[2].Pos = 1 << 40
	if err := m.Validate(); err != nil {
		t.Fatal(err)
	}
	m.Files[0].Chunks[2].Pos = -1
	if err := m.Validate(); err == nil {
		t.Fatal("negative position accepted")
	}
}

// Parse must not accept what it cannot have been written as.
func TestParseNegativeFormat(t *testing.T) {
	if _, err := Parse([]byte(`{"format":-1,"files":[]}`)); err == nil {
		t.Fatal("format -1 accepted")
	}
}

// A chunk position near MaxInt64 overflows Pos+FrameSize+Stored and passes
// the segment bound.
func TestValidatePosOverflow(t *testing.T) {
	m := goodManifest()
	m.Files[2].Chunks[0].Pos = math.MaxInt64 - 20
	if err := m.Validate(); err == nil {
		t.Fatal("chunk at position MaxInt64-20 of a 2000-byte segment accepted")
	}
}

func TestHashText(t *testing.T) {
	h := hashOf(0xa0)
	b, _ := h.MarshalText()
	var g Hash
	if err := g.UnmarshalText(b); err != nil || g != h {
		t.Fatalf("hash text round trip: %v", err)
	}
	if err := g.UnmarshalText(b[:62]); err == nil {
		t.Fatal("short hash accepted")
	}
	if err := g.UnmarshalText(append(b, '0', '0')); err == nil {
		t.Fatal("long hash accepted")
	}
}

func TestIsSegmentName(t *testing.T) {
	tests := []struct {
		name    string
		want    bool
		capture string
	}{
		{SegmentName(0, 0), true, "0000000000000000"},
		{SegmentName(1<<64-1, 12345678), true, "ffffffffffffffff"},
		{"segments/00000001.gcs", true, ""}, // before 2026-11-28
		{"segments/0123456789abcdef-00000001.gcs", true, "0123456789abcdef"},
		{"segments/0123456789ABCDEF-00000001.gcs", false, ""},
		{"segments/0123456789abcde-00000001.gcs", false, ""},
		{"segments/0123456789abcdef-0000001.gcs", false, ""},
		{"segments/0123456789abcdef-00000001-00000001.gcs", false, ""},
		{"segments/-00000001.gcs", false, ""},
		{"segments/0000001.gcs", false, ""},
		{"segments/000000001.gcs", false, ""},
		{"segments/0000000x.gcs", false, ""},
		{"segments/00000001.gc", false, ""},
		{"a/segments/00000001.gcs", false, ""},
		{".00000001.gcs.tmp-1", false, ""},
	}
	for _, tc := range tests {
		if got := IsSegmentName(tc.name); got != tc.want {
			t.Errorf("IsSegmentName(%q) = %v", tc.name, got)
		}
		if c, _ := SegmentCapture(tc.name); tc.want && c != tc.capture {
			t.Errorf("SegmentCapture(%q) = %q, want %q", tc.name, c, tc.capture)
		}
	}
}

// A stream of version 5 with HeaderFlagLateData may carry a file's DATA
// after its FILE-END; any other refuses that DATA frame, naming its offset.
func TestReaderLateData(t *testing.T) {
	for _, late := range []bool{true, false} {
		var buf bytes.Buffer
		w, err := NewWriter(&buf, Header{ShardCount: 1, StreamID: 7, LateData: late})
		if err != nil {
			t.Fatal(err)
		}
		name := []byte("pages-1.img")
		frames := []struct {
			fh      FrameHeader
			payload []byte
		}{
			{FrameHeader{Type: FrameFile, FileID: 1, RawLen: uint32(len(name))}, name},
			{FrameHeader{Type: FrameFileEnd, FileID: 1, Offset: 4, RawLen: 1}, nil},
			{FrameHeader{Type: FrameData, FileID: 1, RawLen: 4, StoredLen: 4}, []byte("abcd")},
		}
		var dataAt int64
		for _, f := range frames {
			fh := f.fh
			pos, err := w.WriteFrame(&fh, f.payload)
			if err != nil {
				t.Fatal(err)
			}
			dataAt = pos
		}
		if err := w.Finish(nil); err != nil {
			t.Fatal(err)
		}
		rd, err := NewReader(bytes.NewReader(buf.Bytes()), "s")
		if err != nil {
			t.Fatal(err)
		}
		if v := rd.Header().Version; late && v != VersionLateData || !late && v >= VersionLateData {
			t.Fatalf("late data %v: written as version %d", late, v)
		}
		var data *Frame
		for err == nil {
			var fr Frame
			if fr, err = rd.Next(nil); err == nil && fr.Type == FrameData {
				data = &fr
			}
		}
		switch {
		case late && (err != io.EOF || data == nil || data.Name != "pages-1.img"):
			t.Fatalf("late data: %v; the DATA frame after FILE-END read as %+v", err, data)
		case !late && (err == io.EOF || !strings.Contains(err.Error(), fmt.Sprintf("offset %d", dataAt))):
			t.Fatalf("without late data: %v, want the DATA frame at offset %d refused", err, dataAt)
		}
	}
}
