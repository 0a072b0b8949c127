package source

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/testwait"
)

// ---- test data ----

// smallRead is the size of a Capture's first read of every file (a
// constant of package streamer): a file up to it is one chunk whatever the
// chunk size, which the expected digests and chunk sizes follow.
const smallRead = 64 << 10

// expectedDigest is the digest streamer.Capture gives a file written with full
// reads: one chunk up to smallRead bytes, else chunks of chunkSize.
// expectedDigest is a file's digest computed from its data as
// docs/FORMAT.md section 8 says: over the chunks' BLAKE3 hashes, or
// without chunk hashes over their CRC-32C and lengths.
func expectedDigest(data []byte, chunkSize int, noChunkHashes bool) [32]byte {
	var covered []byte
	add := func(chunk []byte) {
		if noChunkHashes {
			covered = binary.LittleEndian.AppendUint32(covered, codec.Checksum(chunk))
			covered = binary.LittleEndian.AppendUint32(covered, uint32(len(chunk)))
			return
		}
		h := codec.ContentHash(chunk)
		covered = append(covered, h[:]...)
	}
	if len(data) <= smallRead {
		if len(data) > 0 {
			add(data)
		}
	} else {
		for off := 0; off < len(data); off += chunkSize {
			add(data[off:min(off+chunkSize, len(data))])
		}
	}
	return pipeline.FileDigest(covered, int64(len(data)))
}

// ---- readers ----

// ---- checks ----

// checkDir checks that dir holds exactly want.
func checkDir(t testing.TB, what, dir string, want map[string][]byte) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if len(names) != len(want) {
		t.Errorf("%s: %s holds %d entries, want %d: %v", what, dir, len(names), len(want), names)
	}
	for name, data := range want {
		got, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("%s: extracted %s differs (%d bytes, want %d)", what, name, len(got), len(data))
		}
	}
}

// checkManifest checks what streamer.Capture.Close returned against the data.
func checkManifest(t testing.TB, m *manifest.Manifest, want map[string][]byte, chunkSize int) {
	t.Helper()
	if err := m.Validate(); err != nil {
		t.Fatalf("manifest does not validate: %v", err)
	}
	if len(m.Files) != len(want) {
		t.Fatalf("manifest lists %d files, want %d", len(m.Files), len(want))
	}
	var raw int64
	for i, f := range m.Files {
		if i > 0 && m.Files[i-1].Name >= f.Name {
			t.Fatalf("manifest files not sorted: %s before %s", m.Files[i-1].Name, f.Name)
		}
		data, ok := want[f.Name]
		if !ok {
			t.Fatalf("manifest lists unexpected %s", f.Name)
		}
		if f.Size != int64(len(data)) {
			t.Fatalf("manifest: %s size %d, want %d", f.Name, f.Size, len(data))
		}
		if f.Digest != expectedDigest(data, chunkSize, m.NoChunkHashes) {
			t.Fatalf("manifest: %s digest differs from the chunk hashes of its data", f.Name)
		}
		for _, c := range f.Chunks {
			if int(c.RawLen) > chunkSize && int(c.RawLen) > smallRead {
				t.Fatalf("manifest: %s chunk of %d bytes > chunk size %d", f.Name, c.RawLen, chunkSize)
			}
			chunk := data[c.Offset : c.Offset+int64(c.RawLen)]
			hash := codec.ContentHash(chunk)
			if m.NoChunkHashes {
				hash = [32]byte{}
			}
			if codec.Checksum(chunk) != c.Checksum || hash != c.Hash {
				t.Fatalf("manifest: %s chunk at %d: checksum or hash wrong", f.Name, c.Offset)
			}
			if (codec.ID(c.Codec) == codec.Zero) != codec.IsZero(chunk) {
				t.Fatalf("manifest: %s chunk at %d: codec %v for zero=%v", f.Name, c.Offset, codec.ID(c.Codec), codec.IsZero(chunk))
			}
			raw += int64(c.RawLen)
		}
	}
	if m.Stats.RawBytes != raw {
		t.Fatalf("manifest stats: %d raw bytes, chunks hold %d", m.Stats.RawBytes, raw)
	}
	if want := map[bool]int{false: manifest.VersionPlain, true: manifest.VersionNoChunkHashes}[m.NoChunkHashes]; m.Format != want || m.ChunkSize != chunkSize || m.Created.IsZero() {
		t.Fatalf("manifest header fields: format %d chunk size %d created %v", m.Format, m.ChunkSize, m.Created)
	}
}

// slowStore is a memStore whose segment reads wait until ctx ends (a
// stalled network).
type slowStore struct{ *mem.Store }

func (s slowStore) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
	if strings.HasPrefix(name, manifest.SegmentPrefix) {
		select {
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		case <-time.After(testwait.Scale(30 * time.Second)):
		}
	}
	return s.Store.Open(ctx, name, off, length)
}
