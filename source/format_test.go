package source

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
)

// A stream without chunk hashes (format 3) is checked as strictly as one
// with: a DATA frame may not carry a hash there, the file digest covers
// each chunk's CRC-32C and length (so a chunk swapped for another with a
// right CRC of its own is caught), and every shard must say the same.
func TestNoChunkHashesRules(t *testing.T) {
	a, b := bytes.Repeat([]byte("first chunk "), 100), bytes.Repeat([]byte("second chunk "), 100)
	digest := func(chunks ...[]byte) [32]byte {
		var covered []byte
		var size int
		for _, c := range chunks {
			covered = binary.LittleEndian.AppendUint32(covered, codec.Checksum(c))
			covered = binary.LittleEndian.AppendUint32(covered, uint32(len(c)))
			size += len(c)
		}
		return pipeline.FileDigest(covered, int64(size))
	}
	// stream writes file 0 as the given chunks, hash in each DATA frame,
	// and a FILE-END whose digest is end.
	stream := func(noChunkHashes bool, hash [32]byte, end [32]byte, chunks ...[]byte) []byte {
		var buf bytes.Buffer
		w, err := manifest.NewWriter(&buf, manifest.Header{ShardCount: 1, StreamID: 7, NoChunkHashes: noChunkHashes})
		if err != nil {
			t.Fatal(err)
		}
		frame := func(fh manifest.FrameHeader, payload []byte) {
			if _, err := w.WriteFrame(&fh, payload); err != nil {
				t.Fatal(err)
			}
		}
		frame(manifest.FrameHeader{Type: manifest.FrameFile}, []byte("pages-1.img"))
		var off int
		for _, c := range chunks {
			frame(manifest.FrameHeader{Type: manifest.FrameData, Offset: uint64(off), RawLen: uint32(len(c)), Codec: uint8(codec.None),
				Checksum: codec.Checksum(c), Hash: hash}, c)
			off += len(c)
		}
		frame(manifest.FrameHeader{Type: manifest.FrameFileEnd, Offset: uint64(off), RawLen: uint32(len(chunks)), Hash: end}, nil)
		if err := w.Finish(nil); err != nil {
			t.Fatal(err)
		}
		return buf.Bytes()
	}
	serve := func(verify bool, shards ...[]byte) ([]byte, error) {
		var rs []io.Reader
		var names []string
		for _, s := range shards {
			rs = append(rs, bytes.NewReader(s))
			names = append(names, "shard")
		}
		src := NewStreamSource(context.Background(), rs, names, StreamSourceOptions{Options: pipeline.Options{Workers: 2, VerifyHashes: verify}})
		defer src.Close()
		var got bytes.Buffer
		_, cerr := src.Copy(context.Background(), "pages-1.img", &got)
		if err := src.Wait(context.Background()); err != nil {
			return nil, err
		}
		return got.Bytes(), cerr
	}
	good := stream(true, [32]byte{}, digest(a, b), a, b)
	for _, verify := range []bool{false, true} {
		if got, err := serve(verify, good); err != nil || !bytes.Equal(got, append(bytes.Clone(a), b...)) {
			t.Fatalf("verify=%v: a right format 3 stream: %d bytes, %v", verify, len(got), err)
		}
	}
	for _, tc := range []struct {
		name   string
		shards [][]byte
		want   string
	}{
		{"a chunk with a hash", [][]byte{stream(true, codec.ContentHash(a), digest(a, b), a, b)}, "has a hash in a stream without chunk hashes"},
		{"a chunk swapped, its CRC right", [][]byte{stream(true, [32]byte{}, digest(a, b), a, a)}, "file digest mismatch"},
		{"chunks swapped", [][]byte{stream(true, [32]byte{}, digest(a, b), b, a)}, "file digest mismatch"},
		{"a digest over hashes", [][]byte{stream(true, [32]byte{}, pipeline.FileDigest(append(hashOf(a), hashOf(b)...), int64(len(a)+len(b))), a, b)}, "file digest mismatch"},
		{"shards of two formats", [][]byte{emptyShard(t, 0, true), emptyShard(t, 1, false)}, "another stream"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, verify := range []bool{false, true} {
				got, err := serve(verify, tc.shards...)
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("verify=%v: served %d bytes, error %v; want one saying %q", verify, len(got), err, tc.want)
				}
				if tc.name != "shards of two formats" && !errors.Is(err, errdefs.ErrCorrupt) {
					t.Errorf("verify=%v: error %q does not wrap ErrCorrupt", verify, err)
				}
			}
		})
	}
}

// emptyShard is shard i of a two-shard stream that ends at once.
func emptyShard(t *testing.T, i uint16, noChunkHashes bool) []byte {
	var buf bytes.Buffer
	w, err := manifest.NewWriter(&buf, manifest.Header{ShardIndex: i, ShardCount: 2, StreamID: 7, NoChunkHashes: noChunkHashes})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Finish(nil); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func hashOf(b []byte) []byte {
	h := codec.ContentHash(b)
	return h[:]
}
