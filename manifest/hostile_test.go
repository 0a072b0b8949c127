package manifest

import (
	"bytes"
	"errors"
	"io"
	"math"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
)

// Every cut of a stream is corrupt input (exit 3), including cuts inside
// the 32-byte stream header and inside a 64-byte frame header.
func TestReaderEveryCutIsCorrupt(t *testing.T) {
	ts := writeStream(t, Header{}, []frameSpec{file(0, "a.img"), data(0, 0, []byte("abcdef")), fileEnd(0, 6, 1)}, []byte("{}"))
	for n := range len(ts.b) {
		_, _, err := readAll(ts.b[:n], "cut")
		if !errors.Is(err, errdefs.ErrCorrupt) {
			t.Errorf("cut at %d of %d bytes: %v, want ErrCorrupt", n, len(ts.b), err)
		}
		if n > 0 && err != nil && !strings.Contains(err.Error(), "truncated") {
			t.Errorf("cut at %d of %d bytes: %q does not say the stream is truncated", n, len(ts.b), err)
		}
	}
}

// Validate refuses every name extract refuses, so that verify and inspect
// never pass an archive extract cannot write.
func TestValidateRefusesUnsafeNames(t *testing.T) {
	for _, name := range []string{"../../x", "/tmp/x", "x/y", ".", "..", "", "a\x00b", strings.Repeat("n", MaxNameLen+1)} {
		m := goodManifest()
		m.Files[1].Name = name
		err := m.Validate()
		if err == nil {
			t.Errorf("name %q accepted", name)
			continue
		}
		if strings.ContainsRune(err.Error(), 0) {
			t.Errorf("name %q: error carries a NUL: %q", name, err)
		}
	}
}

// A segment of negative size wraps the bound check: size -2^63 let any
// chunk position pass.
func TestValidateNegativeSegmentSize(t *testing.T) {
	for _, size := range []int64{math.MinInt64, -1} {
		m := goodManifest()
		m.Segments[1].Size = size
		m.Files[0].Chunks[2].Pos = math.MaxInt64 / 2
		if err := m.Validate(); err == nil {
			t.Errorf("segment size %d accepted", size)
		}
		b, err := m.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Parse(b); !errors.Is(err, errdefs.ErrCorrupt) {
			t.Errorf("Parse with segment size %d: %v, want ErrCorrupt", size, err)
		}
	}
}

func TestPrintableName(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"pages-1.img", "pages-1.img"},
		{"ünïcode.img", "ünïcode.img"},
		{"a\x1b[2Jb", `"a\x1b[2Jb"`},
		{"nl\nname", `"nl\nname"`},
		{"bad\xffutf8", `"bad\xffutf8"`},
		{"del\x7f", `"del\x7f"`},
	} {
		if got := PrintableName(tc.in); got != tc.want {
			t.Errorf("PrintableName(%q) = %s, want %s", tc.in, got, tc.want)
		}
	}
}

// A peer's file name reaches error messages escaped.
func TestReaderErrorEscapesNames(t *testing.T) {
	evil := "x\x1b]0;pwned\x07.img"
	ts := writeStream(t, Header{}, []frameSpec{file(0, evil), data(0, 0, []byte("abcdef")), fileEnd(0, 6, 1)}, nil)
	rd, frames, err := readAll(ts.b, "s")
	if err != nil {
		t.Fatal(err)
	}
	msg := rd.FrameErrorf(frames[1], "boom").Error()
	if !strings.Contains(msg, "(file ") {
		t.Fatalf("error names no file: %q", msg)
	}
	if strings.ContainsAny(msg, "\x1b\x07") {
		t.Fatalf("error carries control characters: %q", msg)
	}
}

// Names held stay bounded whatever the input (issue 25 M-a): a file that
// is replaced again and again leaves no name behind once ended, and files
// opened without end are refused past MaxOpenNameBytes. In a stream with
// late data, where ended files keep their names, so is a flood of files
// with one-byte names: each counts lateFileCost more.
func TestReaderNamesBounded(t *testing.T) {
	name := strings.Repeat("n", 4000)
	for _, tc := range []struct {
		what    string
		frames  func(i uint32) []frameSpec
		n       uint32
		late    bool
		corrupt bool
	}{
		{"replacing FILE/FILE-END pairs", func(i uint32) []frameSpec { return []frameSpec{file(i, name), fileEnd(i, 0, 0)} }, 5000, false, false},
		{"FILEs never ended", func(i uint32) []frameSpec { return []frameSpec{file(i, name)} }, MaxOpenNameBytes/4000 + 2, false, true},
		{"late data: tiny names, ended", func(i uint32) []frameSpec { return []frameSpec{file(i, "n"), fileEnd(i, 0, 0)} }, MaxOpenNameBytes/65 + 2, true, true}, // 64 bytes a file beside its one-byte name,
	} {
		t.Run(tc.what, func(t *testing.T) {
			var frames []frameSpec
			for i := range tc.n {
				frames = append(frames, tc.frames(i)...)
			}
			// Written here: writeStream checks every position, quadratic in
			// the half million frames of the late case.
			var buf bytes.Buffer
			w, err := NewWriter(&buf, Header{LateData: tc.late})
			if err != nil {
				t.Fatal(err)
			}
			for _, f := range frames {
				fh := f.fh
				if _, err := w.WriteFrame(&fh, f.payload); err != nil {
					t.Fatal(err)
				}
			}
			if err := w.Finish(nil); err != nil {
				t.Fatal(err)
			}
			rd, err := NewReader(bytes.NewReader(buf.Bytes()), "s")
			if err != nil {
				t.Fatal(err)
			}
			maxHeld := 0
			for {
				_, err = rd.Next(nil)
				maxHeld = max(maxHeld, rd.openNames)
				if err != nil {
					break
				}
			}
			if maxHeld > MaxOpenNameBytes {
				t.Errorf("held %d bytes of names, more than %d", maxHeld, MaxOpenNameBytes)
			}
			if tc.corrupt {
				if !errors.Is(err, errdefs.ErrCorrupt) || !strings.Contains(err.Error(), "open at once") {
					t.Fatalf("err = %v, want ErrCorrupt naming the names open at once", err)
				}
				return
			}
			if err != io.EOF {
				t.Fatal(err)
			}
			if maxHeld > len(name) || len(rd.names) != 0 {
				t.Errorf("held up to %d bytes of names, %d names at the end; want one name at most", maxHeld, len(rd.names))
			}
		})
	}
}
