package source

import (
	"bytes"
	"context"
	"encoding/binary"
	"hash/crc32"
	"io"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/testwait"
)

// lateDataStream is a one-shard stream of files with the page images'
// data last (streamer/late.go), where its last DATA frame of
// pages-1.img starts, and where the file's FILE-END.
func lateDataStream(t *testing.T, files map[string][]byte) (b []byte, last, end int64) {
	t.Helper()
	var buf bytes.Buffer
	out, err := streamer.NewStreamOutputAs([]io.Writer{&buf}, pipeline.Format{LateData: true})
	if err != nil {
		t.Fatal(err)
	}
	captureFiles(t, context.Background(), out, pipeline.Options{ChunkSize: corpusChunk, Workers: 2, Codec: pipelinetest.MustSpec(t, "lz4"), LateData: true}, files)
	last, end = -1, -1
	lastOff := uint64(0)
	_, frs := frames(t, buf.Bytes())
	for _, fr := range frs {
		if fr.Type == manifest.FrameData && fr.Name == "pages-1.img" && codec.ID(fr.Codec) != codec.Zero && (last < 0 || fr.Offset > lastOff) {
			last, lastOff = fr.Pos, fr.Offset
		}
		if fr.Type == manifest.FrameFileEnd && fr.Name == "pages-1.img" {
			end = fr.Pos
		}
	}
	if last < 0 || end < 0 || end > last {
		t.Fatalf("pages-1.img: last DATA frame at %d, FILE-END at %d: not held back", last, end)
	}
	return buf.Bytes(), last, end
}

// gatedStream gives b[:gate], then waits for open to close before the
// rest (or, with cut, ends there).
func gatedStream(b []byte, gate int64, open <-chan struct{}, cut bool) io.Reader {
	pr, pw := io.Pipe()
	go func() {
		if _, err := pw.Write(b[:gate]); err != nil {
			return
		}
		<-open
		if cut {
			pw.CloseWithError(io.ErrUnexpectedEOF)
			return
		}
		_, err := pw.Write(b[gate:])
		pw.CloseWithError(err)
	}()
	return pr
}

// waitLen waits until out holds n bytes.
func waitLen(t *testing.T, out *pipelinetest.SyncBuffer, n int) {
	t.Helper()
	deadline := time.Now().Add(testwait.Scale(10 * time.Second))
	for len(out.Bytes()) < n && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if got := len(out.Bytes()); got != n {
		t.Fatalf("copied %d bytes while the file's last chunk was held back, want %d", got, n)
	}
}

// A page image whose end came ahead of its data is listed (size, zero
// chunks) and copied while it arrives, with ServeEarly: every chunk but the
// last as soon as it is in, the last once the whole file checked; a
// stream that fails or ends meanwhile ends the copy with an error, never
// with the whole file handed over.
func TestStreamServesArriving(t *testing.T) {
	files := corpusFiles()
	pages := files["pages-1.img"]
	b, gate, end := lateDataStream(t, files)
	lastOff := int64(4 * corpusChunk) // corpusFiles: five chunks, the last of 1000 bytes
	for _, tc := range []struct {
		name    string
		corrupt bool // a byte of the last chunk's payload flipped
		digest  bool // the file's digest in its FILE-END wrong (every chunk right)
		cut     bool // the stream ends before the last chunk
	}{
		{name: "whole"},
		{name: "last chunk corrupt", corrupt: true},
		{name: "file digest wrong", digest: true},
		{name: "stream cut", cut: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(30*time.Second))
			defer cancel()
			sb := bytes.Clone(b)
			if tc.corrupt {
				sb[gate+manifest.FrameSize+10] ^= 0x40
			}
			if tc.digest {
				h := sb[end : end+manifest.FrameSize]
				h[28] ^= 1 // the hash field; the header's own checksum made right
				binary.LittleEndian.PutUint32(h[60:], crc32.Checksum(h[:60], crc32.MakeTable(crc32.Castagnoli)))
			}
			open := make(chan struct{})
			src := NewStreamSource(ctx, []io.Reader{gatedStream(sb, gate, open, tc.cut)}, []string{"stream"},
				StreamSourceOptions{Options: pipeline.Options{Workers: 2}, ServeEarly: true})
			defer src.Close()

			f, err := src.Stat(ctx, "pages-1.img")
			if err != nil {
				t.Fatal(err)
			}
			if f.Size != int64(len(pages)) {
				t.Fatalf("Stat of the arriving file: size %d, want %d", f.Size, len(pages))
			}
			zero := false
			for _, c := range f.Chunks {
				zero = zero || (c.Offset == 2*corpusChunk && codec.ID(c.Codec) == codec.Zero)
			}
			if !zero {
				t.Fatalf("Stat of the arriving file lists %d chunks, not its zero chunk at %d", len(f.Chunks), 2*corpusChunk)
			}

			var out pipelinetest.SyncBuffer
			type result struct {
				n   int64
				err error
			}
			done := make(chan result, 1)
			go func() {
				n, err := src.Copy(ctx, "pages-1.img", &out)
				done <- result{n, err}
			}()
			waitLen(t, &out, int(lastOff))
			if !bytes.Equal(out.Bytes(), pages[:lastOff]) {
				t.Fatal("the bytes copied while the file arrived differ from the file's")
			}
			select {
			case r := <-done:
				t.Fatalf("Copy returned (%d, %v) before the file's last chunk came", r.n, r.err)
			case <-time.After(50 * time.Millisecond):
			}
			close(open)
			r := <-done
			if tc.corrupt || tc.digest || tc.cut {
				if r.err == nil {
					t.Fatalf("Copy of a file whose stream failed returned %d bytes and no error", r.n)
				}
				if got := len(out.Bytes()); got != int(lastOff) {
					t.Fatalf("Copy handed over %d bytes of a file that failed, want the %d before its last chunk", got, lastOff)
				}
				return
			}
			if r.err != nil || r.n != int64(len(pages)) || !bytes.Equal(out.Bytes(), pages) {
				t.Fatalf("Copy: %d bytes, %v; the file's %d bytes equal: %v", r.n, r.err, len(pages), bytes.Equal(out.Bytes(), pages))
			}
			pipelinetest.CheckSource(t, ctx, "pages last", src, files)
		})
	}
}

// ScanStream (inspect of a stream without its index, such as one shard of
// several) lists a page image's late chunks too, those after its FILE-END.
func TestScanStreamLateData(t *testing.T) {
	files := corpusFiles()
	var bufs [2]bytes.Buffer
	out, err := streamer.NewStreamOutputAs([]io.Writer{&bufs[0], &bufs[1]}, pipeline.Format{LateData: true})
	if err != nil {
		t.Fatal(err)
	}
	captureFiles(t, context.Background(), out, pipeline.Options{ChunkSize: corpusChunk, Workers: 2, Codec: pipelinetest.MustSpec(t, "lz4"), LateData: true}, files)
	for i := range bufs {
		_, frs := frames(t, bufs[i].Bytes())
		want, late := 0, 0
		for _, fr := range frs {
			if fr.Type == manifest.FrameData && fr.Name == "pages-1.img" {
				want++
				if fr.Late {
					late++
				}
			}
		}
		m, err := ScanStream(bytes.NewReader(bufs[i].Bytes()), "shard")
		if err != nil {
			t.Fatal(err)
		}
		got := -1
		for _, f := range m.Files {
			if f.Name == "pages-1.img" {
				got = len(f.Chunks)
			}
		}
		if late == 0 || got != want {
			t.Fatalf("shard %d: scan lists %d chunks of pages-1.img, the shard holds %d (%d late)", i, got, want, late)
		}
	}
}
