// Package pipelinetest holds the test data, readers, checks and benchmark
// shapes that the tests of both sides of the pipeline (packages streamer
// and source) share: model-like image data, a Source check that reads
// every file twice, goroutine-leak waits, test keys. It imports neither
// side, so that the internal tests of both can use it.
package pipelinetest

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
	"runtime"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/iotest"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
)

// NewRand is a deterministic generator: the same seed, the same data.
func NewRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15)) }

// FillBF16 writes bf16 "weights" from N(0, 0.02).
func FillBF16(b []byte, r *rand.Rand) {
	for i := 0; i+2 <= len(b); i += 2 {
		f := float32(r.NormFloat64() * 0.02)
		binary.LittleEndian.PutUint16(b[i:], uint16(math.Float32bits(f)>>16))
	}
}

// FillFP32 writes fp32 "optimizer state".
func FillFP32(b []byte, r *rand.Rand) {
	for i := 0; i+4 <= len(b); i += 4 {
		binary.LittleEndian.PutUint32(b[i:], math.Float32bits(float32(r.NormFloat64()*0.001)))
	}
}

// FillRandom writes incompressible bytes.
func FillRandom(b []byte, r *rand.Rand) {
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], r.Uint64())
	}
	for i := len(b) &^ 7; i < len(b); i++ {
		b[i] = byte(r.Uint32())
	}
}

var words = strings.Fields("checkpoint restore process memory page kernel tensor cuda stream pipe image socket " +
	"the of and to in is it that was for on are with as be at one have this from or by")

// FillText writes log/heap-like text with repeats.
func FillText(b []byte, r *rand.Rand) {
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

// FillPages writes page-like data: pointers, small ints, zero runs.
func FillPages(b []byte, r *rand.Rand) {
	for i := 0; i+8 <= len(b); i += 8 {
		switch r.IntN(4) {
		case 0:
			binary.LittleEndian.PutUint64(b[i:], 0x7f0000000000+uint64(r.IntN(1<<20))*8)
		case 1:
			binary.LittleEndian.PutUint64(b[i:], uint64(r.IntN(256)))
		}
	}
}

// MixedData is model-like content: weight tensors, zero regions (aligned
// and not to chunks), noise, text, pages; it ends in zeros.
func MixedData(n int, seed uint64) []byte {
	r := NewRand(seed)
	b := make([]byte, n)
	fills := []func([]byte, *rand.Rand){FillBF16, nil, FillRandom, FillText, FillFP32, nil, FillPages}
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

// SmallData is a small file of one of several kinds.
func SmallData(n int, seed uint64) []byte {
	r := NewRand(seed)
	b := make([]byte, n)
	switch seed % 4 {
	case 0:
		FillText(b, r)
	case 1:
		FillRandom(b, r)
	case 2:
		// all zero
	case 3:
		FillPages(b, r)
	}
	return b
}

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

// Source is what CheckSource reads: the methods of source.Source (whose
// own tests use this package, which therefore cannot import it).
type Source interface {
	Stat(ctx context.Context, name string) (manifest.File, error)
	Copy(ctx context.Context, name string, w io.Writer) (int64, error)
	Files(ctx context.Context) ([]manifest.File, error)
}

// CheckSource checks that src serves exactly want, each file twice.
func CheckSource(t testing.TB, ctx context.Context, what string, src Source, want map[string][]byte) {
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

// WaitGoroutines waits until the goroutine count drops to at most n.
func WaitGoroutines(t testing.TB, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := runtime.NumGoroutine()
		if got <= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines still running, want at most %d:\n%s", got, n, GoroutineDump())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// GoroutineDump is every goroutine's stack, for a test that hangs.
func GoroutineDump() string {
	var sb strings.Builder
	_ = pprof.Lookup("goroutine").WriteTo(&sb, 1)
	return sb.String()
}

// MustSpec parses a codec spec or fails the test.
func MustSpec(t testing.TB, s string) codec.Spec {
	t.Helper()
	sp, err := codec.ParseSpec(s)
	if err != nil {
		t.Fatal(err)
	}
	return sp
}

// CountGoroutines is the number of goroutines now, for WaitGoroutines.
func CountGoroutines() int { return runtime.NumGoroutine() }

// Reader returns one of several reader behaviours for b.
func Reader(b []byte, i int) io.Reader {
	switch i % 5 {
	case 1:
		return &chunkyReader{bytes.NewReader(b), 4097}
	case 2:
		return &eofWithDataReader{b}
	case 3:
		return iotest.HalfReader(bytes.NewReader(b))
	case 4:
		return iotest.DataErrReader(bytes.NewReader(b))
	}
	return bytes.NewReader(b)
}

// Key is a test key derived from seed: the same seed, the same key.
func Key(t testing.TB, seed byte) *crypt.Key {
	t.Helper()
	b := bytes.Repeat([]byte{seed}, crypt.KeySize)
	b[0] ^= 0x5a
	k, err := crypt.NewKey(b)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// Session starts a new encryption session (a new salt) under k.
func Session(t testing.TB, k *crypt.Key) *crypt.Session {
	t.Helper()
	s, err := crypt.NewSession(k)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// Benchmark sizes, in MiB, from the environment so that a quick run
// (-benchtime 1x, small sizes) and a real measurement use the same code:
//
//	GPUCR_BENCH_MIB         bytes per Capture iteration (default 1024)
//	GPUCR_BENCH_SOURCE_MIB  checkpoint size for the source benchmarks (default 256)
//	GPUCR_BENCH_CODECS      space-separated codecs, e.g. "lz4 zstd" (default all)
func BenchMiB(env string, def int) int64 {
	if v, err := strconv.Atoi(os.Getenv(env)); err == nil && v > 0 {
		return int64(v) << 20
	}
	return int64(def) << 20
}

// BenchCodecs are the codecs the capture benchmarks run: $GPUCR_BENCH_CODECS or all.
func BenchCodecs() []string {
	if v := os.Getenv("GPUCR_BENCH_CODECS"); v != "" {
		return strings.Fields(v)
	}
	return []string{"none", "lz4", "zstd", "zstd:3", "auto", "shuffle"}
}

// BenchTemplate is 64 MiB of model-like content (bf16 and fp32 tensors,
// zero regions, pages, text, noise) that the benchmark readers repeat.
var BenchTemplate = sync.OnceValue(func() []byte { return MixedData(64<<20, 99) })

// RepeatReader reads n bytes of the template, starting at off.
type RepeatReader struct {
	Tmpl []byte
	Off  int64
	N    int64
}

// Read implements io.Reader.
func (r *RepeatReader) Read(p []byte) (int, error) {
	if r.N <= 0 {
		return 0, io.EOF
	}
	i := r.Off % int64(len(r.Tmpl))
	k := copy(p[:min(int64(len(p)), r.N)], r.Tmpl[i:])
	r.Off += int64(k)
	r.N -= int64(k)
	return k, nil
}

// BenchFiles splits total into a checkpoint's shape: one large pages
// image (the process memory, VRAM included), a second large one, and many
// small images; returns name -> (offset into the template, size).
func BenchFiles(total int64) map[string][2]int64 {
	files := map[string][2]int64{}
	const small = 48
	smallSize := int64(16 << 10)
	rest := total - small*smallSize
	if rest < 2 {
		rest, smallSize = total, 0
	}
	files["pages-1.img"] = [2]int64{0, rest * 7 / 8}
	files["pages-2.img"] = [2]int64{rest * 7 / 8, rest - rest*7/8}
	for i := range small {
		if smallSize > 0 {
			files[fmt.Sprintf("core-%d.img", i)] = [2]int64{int64(i) * 7919 * 4096, smallSize}
		}
	}
	return files
}

// Capture is what CaptureBench and the checks need of a
// streamer.Capture (package streamer's tests use this package, which
// therefore cannot import it).
type Capture interface {
	WriteFile(name string, r io.Reader, external bool) (int64, error)
	Close(ctx context.Context, meta manifest.Manifest) (*manifest.Manifest, error)
}

// CaptureBench returns what writes the benchmark checkpoint (BenchFiles
// of total bytes) through a new capture and closes it; it takes
// NewCapture's results, so that a call reads
// CaptureBench(b, total)(streamer.NewCapture(ctx, out, opts)).
func CaptureBench(tb testing.TB, total int64) func(Capture, error) *manifest.Manifest {
	return func(c Capture, err error) *manifest.Manifest {
		tb.Helper()
		if err != nil {
			tb.Fatal(err)
		}
		return captureBench(tb, c, total)
	}
}

func captureBench(tb testing.TB, c Capture, total int64) *manifest.Manifest {
	ctx := context.Background()
	tmpl := BenchTemplate()
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for name, f := range BenchFiles(total) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := c.WriteFile(name, &RepeatReader{Tmpl: tmpl, Off: f[0], N: f[1]}, false); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		tb.Fatal(err)
	}
	m, err := c.Close(ctx, manifest.Manifest{Tool: "bench"})
	if err != nil {
		tb.Fatal(err)
	}
	return m
}

// BenchmarkCaptureSealed and BenchmarkStreamSourceSealed run the pipeline
// plain and encrypted on the same data in one run, so the cost of
// encryption is their ratio (GPUCR_BENCH_MIB, GPUCR_BENCH_SOURCE_MIB and
// GPUCR_BENCH_CODECS as for the other benchmarks; default codec lz4).
// SealedBenchCodecs are the codecs the sealed benchmarks run: lz4 unless
// $GPUCR_BENCH_CODECS names others.
func SealedBenchCodecs() []string {
	if c := BenchCodecs(); len(c) != 6 {
		return c
	}
	return []string{"lz4"}
}

// BenchSession is a session under a fixed benchmark key.
func BenchSession(b *testing.B) *crypt.Session {
	k, err := crypt.NewKey(bytes.Repeat([]byte{5}, crypt.KeySize))
	if err != nil {
		b.Fatal(err)
	}
	return Session(b, k)
}

// SyncBuffer is a bytes.Buffer that one goroutine writes while a test
// reads it.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// Bytes is a copy of what was written so far.
func (s *SyncBuffer) Bytes() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return bytes.Clone(s.b.Bytes())
}

func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
