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
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/streamer"
)

// lendingShard gives every DATA payload as the stream's own memory, as a
// migration receiver's chunk cache gives the frames sent by reference.
type lendingShard struct {
	*bytes.Reader
	b    []byte
	gave int
}

func (h *lendingShard) LendPayload(n int) []byte {
	pos := len(h.b) - h.Len()
	if pos+n > len(h.b) {
		return nil
	}
	h.Seek(int64(n), io.SeekCurrent)
	h.gave++
	return h.b[pos : pos+n]
}

func plainStream(t *testing.T, files map[string][]byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	out, err := streamer.NewStreamOutputAs([]io.Writer{&buf}, pipeline.Format{ChunkHashes: true})
	if err != nil {
		t.Fatal(err)
	}
	captureFiles(t, context.Background(), out, pipeline.Options{ChunkSize: corpusChunk, Workers: 2, Codec: pipelinetest.MustSpec(t, "lz4")}, files)
	return buf.Bytes()
}

// A stream source takes borrowed payloads as they are: it serves them (by
// vmsplice into a pipe too), never writes them, does not count them
// against its memory, and still checks them.
func TestStreamBorrowedPayloads(t *testing.T) {
	ctx := context.Background()
	files := corpusFiles()
	b := plainStream(t, files)
	pristine := bytes.Clone(b)
	so := StreamSourceOptions{Options: pipeline.Options{Workers: 2, VerifyHashes: true}}

	plain := readStream(ctx, [][]byte{b}, so)
	defer plain.Close()
	pipelinetest.CheckSource(t, ctx, "plain", plain, files)
	hs := &lendingShard{Reader: bytes.NewReader(b), b: b}
	borrowing := NewStreamSource(ctx, []io.Reader{hs}, []string{"shard 0"}, so)
	defer borrowing.Close()
	pipelinetest.CheckSource(t, ctx, "borrowing", borrowing, files)
	if hs.gave == 0 {
		t.Fatal("no payload was borrowed")
	}
	got, err := copyThroughPipe(ctx, borrowing, "pages-1.img", false, -1)
	if err != nil || !bytes.Equal(got, files["pages-1.img"]) {
		t.Fatalf("borrowed pages through a pipe: %v (equal %v)", err, bytes.Equal(got, files["pages-1.img"]))
	}
	if !bytes.Equal(b, pristine) {
		t.Fatal("the stream source wrote into borrowed memory")
	}
	// The raw (noise) chunk is the reader's, not the source's, memory.
	if p, h := plain.buffered(), borrowing.buffered(); p-h < corpusChunk {
		t.Errorf("borrowed payloads counted: %d bytes held with them, %d without", h, p)
	}

	// A flipped byte in a borrowed raw chunk fails its checksum, named.
	pos, name, off := rawChunk(t, b)
	bad := bytes.Clone(b)
	bad[pos+manifest.FrameSize+100] ^= 1
	src := NewStreamSource(ctx, []io.Reader{&lendingShard{Reader: bytes.NewReader(bad), b: bad}}, []string{"shard 0"}, so)
	defer src.Close()
	err = src.Wait(ctx)
	if !errors.Is(err, errdefs.ErrCorrupt) || !bytes.Contains([]byte(err.Error()), fmt.Appendf(nil, "shard 0 at offset %d (file %s): chunk at file offset %d", pos, name, off)) {
		t.Fatalf("damaged borrowed chunk: %v", err)
	}

	// Its content id too, when asked to (--verify).
	h := newHostile(t)
	h.file(0, "pages-1.img")
	raw := bytes.Repeat([]byte("not what the id says "), 1000)
	other := codec.ContentHash([]byte("other bytes"))
	h.frame(manifest.FrameHeader{Type: manifest.FrameData, FileID: 0, RawLen: uint32(len(raw)), Codec: uint8(codec.None),
		Checksum: codec.Checksum(raw), Hash: other}, raw)
	h.fileEnd(0, uint64(len(raw)), [][32]byte{other})
	bad = h.bytes()
	src = NewStreamSource(ctx, []io.Reader{&lendingShard{Reader: bytes.NewReader(bad), b: bad}}, []string{"shard 0"}, so)
	defer src.Close()
	if err := src.Wait(ctx); !errors.Is(err, errdefs.ErrCorrupt) || !strings.Contains(err.Error(), "content hash mismatch") {
		t.Fatalf("borrowed chunk whose id is not its bytes', verified: %v", err)
	}

	// Sealed payloads are opened in place: never borrowed.
	k := pipelinetest.Key(t, 1)
	shards, _ := sealedStream(t, k, "none", files, 1)
	pristine = bytes.Clone(shards[0])
	sh := &lendingShard{Reader: bytes.NewReader(shards[0]), b: shards[0]}
	sealed := NewStreamSource(ctx, []io.Reader{sh}, []string{"shard 0"}, StreamSourceOptions{Options: pipeline.Options{Workers: 2, Key: k}})
	defer sealed.Close()
	pipelinetest.CheckSource(t, ctx, "sealed", sealed, files)
	if sh.gave != 0 || !bytes.Equal(shards[0], pristine) {
		t.Fatalf("sealed stream: %d payloads borrowed, memory unchanged %v", sh.gave, bytes.Equal(shards[0], pristine))
	}
}

// rawChunk finds the first DATA frame stored raw in a stream: where it is
// in the stream, its file, and where in that.
func rawChunk(t *testing.T, b []byte) (pos int64, name string, off uint64) {
	t.Helper()
	rd, err := manifest.NewReader(bytes.NewReader(b), "stream")
	if err != nil {
		t.Fatal(err)
	}
	for {
		fr, err := rd.Next(nil)
		if err != nil {
			t.Fatalf("no raw chunk: %v", err)
		}
		if fr.Type == manifest.FrameData && codec.ID(fr.Codec) == codec.None && fr.StoredLen > 1000 {
			return fr.Pos, fr.Name, fr.Offset
		}
	}
}
