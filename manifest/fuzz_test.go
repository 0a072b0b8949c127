package manifest

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"math"
	"math/rand/v2"
	"runtime"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
)

// fuzzStream is a valid multi-file stream with arbitrary DATA payload
// bytes; late puts every FILE-END before the data (late data, version 5).
func fuzzStream(tb testing.TB, seed uint64, trailer []byte, late bool) []byte {
	r := rand.New(rand.NewPCG(seed, 1))
	var frames []frameSpec
	sizes := map[uint32]uint64{}
	counts := map[uint32]uint32{}
	nfiles := 1 + r.IntN(4)
	for id := range uint32(nfiles) {
		frames = append(frames, file(id, []string{"pages-1.img", "pagemap-1.img", "core-1.img", "inventory.img"}[id]))
	}
	var datas []frameSpec
	for range 2 + r.IntN(6) {
		id := uint32(r.IntN(nfiles))
		p := make([]byte, r.IntN(300))
		for i := range p {
			p[i] = byte(r.Uint32())
		}
		if len(p) == 0 {
			p = []byte{0}
		}
		fs := data(id, sizes[id], p)
		fs.fh.Codec = uint8(r.IntN(6))
		datas = append(datas, fs)
		sizes[id] += uint64(len(p))
		counts[id]++
	}
	var ends []frameSpec
	for id := range uint32(nfiles) {
		ends = append(ends, fileEnd(id, sizes[id], counts[id]))
	}
	if late {
		frames = append(append(frames, ends...), datas...)
	} else {
		frames = append(append(frames, datas...), ends...)
	}
	return writeStream(tb, Header{StreamID: seed, LateData: late}, frames, trailer).b
}

func FuzzReader(f *testing.F) {
	for seed := range uint64(4) {
		var trailer []byte
		if seed%2 == 1 {
			trailer = []byte(`{"format":1,"files":[]}`)
		}
		b := fuzzStream(f, seed, trailer, seed >= 2)
		f.Add(b)
		// Truncations, at frame boundaries and inside frames.
		for _, n := range []int{0, 1, HeaderSize - 1, HeaderSize, HeaderSize + 1, HeaderSize + FrameSize, HeaderSize + FrameSize + 3, len(b) / 2, len(b) - TailSize - 1, len(b) - TailSize, len(b) - 1} {
			if n >= 0 && n < len(b) {
				f.Add(bytes.Clone(b[:n]))
			}
		}
	}
	// A frame header claiming a huge payload, with little behind it.
	big := bytes.Clone(fuzzStream(f, 9, nil, false)[:HeaderSize])
	big = append(big, rawFrame(FrameHeader{Type: FrameEnd, StoredLen: MaxPayload}, []byte("short"))...)
	f.Add(big)
	f.Add(append(bytes.Clone(big[:HeaderSize]), rawFrame(FrameHeader{Type: FrameFile, FileID: 1, StoredLen: MaxNameLen}, nil)...))
	f.Add([]byte(StreamMagic))

	f.Fuzz(func(t *testing.T, in []byte) {
		var before runtime.MemStats
		runtime.ReadMemStats(&before)
		// Inputs of odd length are read as a chunk cache's frames are:
		// DATA payloads of 64 bytes or more lent by the reader.
		borrow := len(in)%2 == 1
		rd, err := NewReader(&lendingReader{Reader: bytes.NewReader(in), b: in, min: 64}, "fuzz")
		if err != nil {
			if rd != nil {
				t.Fatal("NewReader returned a reader and an error")
			}
			return
		}
		if borrow {
			rd.BorrowPayloads()
		}
		if h := rd.Header(); h.Version == 0 || h.Version > Version || h.ShardIndex >= h.ShardCount {
			t.Fatalf("accepted header %+v", h)
		}
		// Each successful frame consumes at least FrameSize bytes, so this
		// many calls must end the stream one way or the other.
		limit := len(in)/FrameSize + 2
		lastPos := int64(-1)
		frames := 0
		open := map[uint32]string{} // the files open, as the frames say
		openBytes := 0
		lateData := rd.Header().LateData
		ended := map[uint32]bool{} // with late data: the files whose FILE-END was read
		sawLate := false
		for calls := 0; ; calls++ {
			if calls > limit {
				t.Fatalf("Reader did not stop after %d calls on %d bytes", calls, len(in))
			}
			fr, err := rd.Next(func(fh FrameHeader) ([]byte, error) {
				if fh.StoredLen > MaxPayload || fh.Type != FrameData {
					t.Fatalf("alloc for a %s frame of %d bytes", fh.Type, fh.StoredLen)
				}
				return make([]byte, fh.StoredLen), nil
			})
			if err == io.EOF {
				if rd.Pos() > int64(len(in)) {
					t.Fatalf("Pos %d past the input's %d bytes", rd.Pos(), len(in))
				}
				// EOF stays EOF.
				if _, err := rd.Next(nil); err != io.EOF {
					t.Fatalf("Next after EOF = %v", err)
				}
				break
			}
			if err != nil {
				if err.Error() == "" {
					t.Fatal("empty error message")
				}
				break
			}
			frames++
			if fr.Pos <= lastPos || fr.Pos < HeaderSize {
				t.Fatalf("frame at %d after one at %d", fr.Pos, lastPos)
			}
			lastPos = fr.Pos
			if openBytes > MaxOpenNameBytes {
				t.Fatalf("%d bytes of names open, more than MaxOpenNameBytes", openBytes)
			}
			if len(fr.Payload) != int(fr.StoredLen) || fr.StoredLen > MaxPayload {
				t.Fatalf("payload of %d bytes, header says %d", len(fr.Payload), fr.StoredLen)
			}
			if fr.Pos+FrameSize+int64(fr.StoredLen) > int64(len(in)) {
				t.Fatalf("frame at %d with %d payload bytes runs past the input", fr.Pos, fr.StoredLen)
			}
			if want := borrow && fr.Type == FrameData && fr.StoredLen >= 64; fr.Borrowed != want || want && &fr.Payload[0] != &in[fr.Pos+FrameSize] {
				t.Fatalf("%v frame of %d bytes: Borrowed %v, want %v, or not the reader's bytes", fr.Type, fr.StoredLen, fr.Borrowed, want)
			}
			switch fr.Type {
			case FrameFile:
				if sawLate {
					t.Fatalf("FILE frame after late data: %+v", fr.FrameHeader)
				}
				if len(fr.Payload) == 0 || len(fr.Payload) > MaxNameLen || rd.FileName(fr.FileID) != string(fr.Payload) || fr.Name != string(fr.Payload) {
					t.Fatalf("FILE frame %+v", fr.FrameHeader)
				}
				if open[fr.FileID] == "" {
					open[fr.FileID] = fr.Name
					openBytes += len(fr.Name)
					if lateData {
						openBytes += lateFileCost
					}
				}
			case FrameData, FrameFileEnd:
				if fr.Name == "" || fr.Name != open[fr.FileID] {
					t.Fatalf("%v frame for unopened file %d", fr.Type, fr.FileID)
				}
				if fr.Type == FrameData && fr.Late != ended[fr.FileID] {
					t.Fatalf("DATA frame of file %d: Late %v, its FILE-END read %v", fr.FileID, fr.Late, ended[fr.FileID])
				}
				sawLate = sawLate || fr.Late
				if fr.Type == FrameFileEnd && lateData {
					// Its late data may come: still named.
					if rd.FileName(fr.FileID) == "" {
						t.Fatalf("file %d forgotten at its FILE-END in a stream with late data", fr.FileID)
					}
					ended[fr.FileID] = true
				} else if fr.Type == FrameFileEnd {
					// Ended: forgotten, so that names held stay bounded.
					if rd.FileName(fr.FileID) != "" {
						t.Fatalf("file %d still named after its FILE-END", fr.FileID)
					}
					delete(open, fr.FileID)
					openBytes -= len(fr.Name)
				}
				if fr.Type == FrameData && fr.RawLen > MaxPayload {
					t.Fatalf("DATA raw length %d", fr.RawLen)
				}
			case FrameEnd:
			default:
				t.Fatalf("frame type %v returned", fr.Type)
			}
			if fr.Type != FrameData && PayloadChecksum(fr.Payload) != fr.Checksum {
				t.Fatalf("%v frame payload checksum not checked", fr.Type)
			}
		}
		// Allocation: the payload buffers of the frames read plus one that
		// failed, each at most MaxPayload, plus small change.
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		if got, max := after.TotalAlloc-before.TotalAlloc, uint64(frames+1)*MaxPayload+1<<20; got > max {
			t.Fatalf("allocated %d bytes for %d frames of a %d-byte input", got, frames, len(in))
		}
	})
}

func FuzzParseManifest(f *testing.F) {
	good, err := goodManifest().Marshal()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	compact, _ := json.Marshal(goodManifest())
	f.Add(compact)
	f.Add([]byte(`{"format":1,"files":[]}`))
	f.Add([]byte(`{"format":1}`))
	f.Add([]byte(`{"format":2}`))
	f.Add([]byte(`{"format":-1,"files":[{"name":"a","size":0,"chunks":[]}]}`))
	f.Add([]byte(`{"format":1,"segments":[{"name":"s","size":100}],"files":[{"name":"a","size":5,"chunks":[{"off":0,"raw":5,"stored":5,"seg":0,"pos":9223372036854775800}]}]}`))
	f.Add([]byte(`{"format":1,"files":[{"name":"a","size":5,"chunks":[{"off":0,"raw":5,"stored":5,"seg":3,"pos":0}]}]}`))
	f.Add([]byte(`null`))
	f.Add([]byte(`{"format":1,"files":null,"segments":[]}`))
	f.Add([]byte(`{"format":1,"segments":[],"files":[{"name":"a","size":5,"chunks":[{"off":0,"raw":5,"seg":0}]}]}`))

	f.Fuzz(func(t *testing.T, in []byte) {
		m, err := Parse(in)
		if err != nil {
			if m != nil {
				t.Fatal("Parse returned a manifest and an error")
			}
			if errors.Is(err, ErrNewerVersion) && errors.Is(err, errdefs.ErrCorrupt) {
				t.Fatalf("error is both newer and corrupt: %v", err)
			}
			return
		}
		if m.Format < 1 || m.Format > Version {
			if m.Format < 1 {
			}
			t.Fatalf("accepted format %d", m.Format)
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("Parse accepted what Validate rejects: %v", err)
		}
		// What downstream code relies on: names unique and non-empty,
		// chunks tile the file, every chunk inside an existing segment.
		names := map[string]bool{}
		for _, fl := range m.Files {
			if fl.Name == "" || names[fl.Name] {
				t.Fatalf("file name %q empty or repeated", fl.Name)
			}
			names[fl.Name] = true
			var next int64
			for _, c := range fl.Chunks {
				if c.Offset != next || c.RawLen == 0 || c.RawLen > MaxPayload || c.Stored > MaxPayload || c.Pos < 0 {
					t.Fatalf("file %s: bad chunk %+v", fl.Name, c)
				}
				next += int64(c.RawLen)
				if m.Segments != nil {
					if c.Segment < 0 || c.Segment >= len(m.Segments) {
						t.Fatalf("file %s: chunk in segment %d of %d", fl.Name, c.Segment, len(m.Segments))
					}
					if size := m.Segments[c.Segment].Size; c.Pos > math.MaxInt64-FrameSize-int64(c.Stored) || c.Pos+FrameSize+int64(c.Stored) > size {
						t.Fatalf("file %s: chunk at %d+%d past segment size %d", fl.Name, c.Pos, c.Stored, size)
					}
				}
			}
			if next != fl.Size {
				t.Fatalf("file %s: chunks hold %d bytes, size %d", fl.Name, next, fl.Size)
			}
			if got, ok := m.Lookup(fl.Name); !ok || got.Name != fl.Name {
				t.Fatalf("Lookup(%q) failed", fl.Name)
			}
		}
		// What Parse accepts, Marshal writes back in a form Parse accepts
		// and that describes the same checkpoint.
		b, err := m.Marshal()
		if err != nil {
			t.Fatalf("Marshal: %v", err)
		}
		m2, err := Parse(b)
		if err != nil {
			t.Fatalf("re-Parse of Marshal output: %v\n%s", err, b)
		}
		b2, err := m2.Marshal()
		if err != nil || !bytes.Equal(b, b2) {
			t.Fatalf("Marshal not stable:\n%s\n%s", b, b2)
		}
	})
}
