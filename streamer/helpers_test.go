package streamer

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store/mem"
)

// ---- test data ----

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15)) }

// fillBF16 writes bf16 "weights" from N(0, 0.02).
func fillBF16(b []byte, r *rand.Rand) {
	for i := 0; i+2 <= len(b); i += 2 {
		f := float32(r.NormFloat64() * 0.02)
		binary.LittleEndian.PutUint16(b[i:], uint16(math.Float32bits(f)>>16))
	}
}

// fillFP32 writes fp32 "optimizer state".
func fillFP32(b []byte, r *rand.Rand) {
	for i := 0; i+4 <= len(b); i += 4 {
		binary.LittleEndian.PutUint32(b[i:], math.Float32bits(float32(r.NormFloat64()*0.001)))
	}
}

func fillRandom(b []byte, r *rand.Rand) {
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], r.Uint64())
	}
	for i := len(b) &^ 7; i < len(b); i++ {
		b[i] = byte(r.Uint32())
	}
}

var words = strings.Fields("checkpoint restore process memory page kernel tensor cuda stream pipe image socket " +
	"the of and to in is it that was for on are with as be at one have this from or by")

// fillText writes log/heap-like text with repeats.
func fillText(b []byte, r *rand.Rand) {
	var sb bytes.Buffer
	for sb.Len() < len(b) {
		sb.WriteString(words[r.IntN(len(words))])
		if r.IntN(9) == 0 {
			fmt.Fprintf(&sb, " 0x%08x\n", r.Uint32()&0xffff00)
		} else {
			sb.WriteByte(' ')
		}
	}
	copy(b, sb.Bytes())
}

// fillPages writes page-like data: pointers, small ints, zero runs.
func fillPages(b []byte, r *rand.Rand) {
	for i := 0; i+8 <= len(b); i += 8 {
		switch r.IntN(4) {
		case 0:
			binary.LittleEndian.PutUint64(b[i:], 0x7f0000000000+uint64(r.IntN(1<<20))*8)
		case 1:
			binary.LittleEndian.PutUint64(b[i:], uint64(r.IntN(256)))
		}
	}
}

// mixedData is model-like content: weight tensors, zero regions (aligned
// and not to chunks), noise, text, pages; it ends in zeros.
func mixedData(n int, seed uint64) []byte {
	r := newRand(seed)
	b := make([]byte, n)
	fills := []func([]byte, *rand.Rand){fillBF16, nil, fillRandom, fillText, fillFP32, nil, fillPages}
	off := 0
	for i := 0; off < n; i++ {
		// Region sizes from 100 KB to 3 MB, deliberately not chunk multiples.
		size := min(n-off, 100_000+r.IntN(3<<20))
		if f := fills[i%len(fills)]; f != nil {
			f(b[off:off+size], r)
		}
		off += size
	}
	// A trailing zero region of more than one chunk.
	clear(b[max(0, n-600_000):])
	return b
}

// smallData is a small file of one of several kinds.
func smallData(n int, seed uint64) []byte {
	r := newRand(seed)
	b := make([]byte, n)
	switch seed % 4 {
	case 0:
		fillText(b, r)
	case 1:
		fillRandom(b, r)
	case 2:
		// all zero
	case 3:
		fillPages(b, r)
	}
	return b
}

// expectedDigest is the digest Capture gives a file written with full
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
	return FileDigest(covered, int64(len(data)))
}

// ---- readers ----

// chunkyReader returns at most n bytes per Read.
type chunkyReader struct {
	r io.Reader
	n int
}

func (c *chunkyReader) Read(p []byte) (int, error) {
	if len(p) > c.n {
		p = p[:c.n]
	}
	return c.r.Read(p)
}

// eofWithDataReader returns the last bytes together with io.EOF.
type eofWithDataReader struct{ b []byte }

func (e *eofWithDataReader) Read(p []byte) (int, error) {
	n := copy(p, e.b)
	e.b = e.b[n:]
	if len(e.b) == 0 {
		return n, io.EOF
	}
	return n, nil
}

// ---- checks ----

// checkSource checks that src serves exactly want, each file twice.
func checkSource(t testing.TB, ctx context.Context, what string, src Source, want map[string][]byte) {
	t.Helper()
	files, err := src.Files(ctx)
	if err != nil {
		t.Fatalf("%s: Files: %v", what, err)
	}
	var got, exp []string
	for _, f := range files {
		got = append(got, fmt.Sprintf("%s:%d", f.Name, f.Size))
	}
	for n, b := range want {
		exp = append(exp, fmt.Sprintf("%s:%d", n, len(b)))
	}
	sort.Strings(exp)
	sort.Strings(got)
	if strings.Join(got, " ") != strings.Join(exp, " ") {
		t.Fatalf("%s: Files() =\n%v\nwant\n%v", what, got, exp)
	}
	for name, data := range want {
		st, err := src.Stat(ctx, name)
		if err != nil || st.Size != int64(len(data)) || st.Name != name {
			t.Fatalf("%s: Stat(%s) = %+v, %v; want size %d", what, name, st, err, len(data))
		}
		for i := range 2 {
			var buf bytes.Buffer
			n, err := src.Copy(ctx, name, &buf)
			if err != nil {
				t.Fatalf("%s: Copy(%s) #%d: %v", what, name, i+1, err)
			}
			if n != int64(len(data)) || !bytes.Equal(buf.Bytes(), data) {
				t.Fatalf("%s: Copy(%s) #%d: %d bytes (%d returned), want %d; equal=%v", what, name, i+1, buf.Len(), n, len(data), bytes.Equal(buf.Bytes(), data))
			}
		}
	}
	if _, err := src.Stat(ctx, "missing.img"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("%s: Stat(missing.img) = %v, want errdefs.ErrNotFound", what, err)
	}
	if _, err := src.Copy(ctx, "missing.img", io.Discard); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("%s: Copy(missing.img) = %v, want errdefs.ErrNotFound", what, err)
	}
}

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

// checkManifest checks what Capture.Close returned against the data.
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

// waitGoroutines waits until the goroutine count drops to at most n.
func waitGoroutines(t testing.TB, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := runtime.NumGoroutine()
		if got <= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines still running, want at most %d:\n%s", got, n, goroutineDump())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func goroutineDump() string {
	var sb strings.Builder
	_ = pprof.Lookup("goroutine").WriteTo(&sb, 1)
	return sb.String()
}

func mustSpec(t testing.TB, s string) codec.Spec {
	t.Helper()
	sp, err := codec.ParseSpec(s)
	if err != nil {
		t.Fatal(err)
	}
	return sp
}

func countGoroutines() int { return runtime.NumGoroutine() }

// slowStore is a memStore whose segment reads wait until ctx ends (a
// stalled network).
type slowStore struct{ *mem.Store }

func (s slowStore) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
	if strings.HasPrefix(name, manifest.SegmentPrefix) {
		select {
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		case <-time.After(30 * time.Second):
		}
	}
	return s.Store.Open(ctx, name, off, length)
}
