// Package vramtest runs libgpucr-preload for tests of the GPU fast path:
// it builds the library, a fake CUDA driver (preload/testdata/
// fake_cuda.c: host memory behind the driver's entry points) and a test
// program that reaches the driver the way the CUDA runtime does
// (preload/testdata/fp_target.c), starts that program with the library,
// and checks its memory, its VRAM files and their records. It needs a C
// compiler: in CI (CI=true) its absence fails the tests. Only tests
// import it.
package vramtest

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/testwait"
)

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

// Build builds the library, the fake driver and the test program once per
// test binary, and returns their directory.
func Build(t testing.TB) string {
	t.Helper()
	cc, err := exec.LookPath("cc")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("no C compiler (cc): the fast-path tests need one in CI")
		}
		t.Skip("no C compiler (cc)")
	}
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "gpucr-preload-test-")
		if buildErr != nil {
			return
		}
		_, here, _, _ := runtime.Caller(0)
		src := filepath.Join(filepath.Dir(here), "..", "..", "preload")
		lib, _ := filepath.Glob(filepath.Join(src, "*.c")) // the library's files
		steps := [][]string{
			{cc, "-O2", "-Wall", "-fPIC", "-shared", "-o", filepath.Join(buildDir, "lib", "libcuda.so.1"), filepath.Join(src, "testdata", "fake_cuda.c")},
			append(append([]string{cc, "-O2", "-Wall", "-fPIC", "-shared", "-o", filepath.Join(buildDir, preloadctl.Library)}, lib...), "-ldl", "-lpthread"),
			{cc, "-O2", "-Wall", "-o", filepath.Join(buildDir, "fp_target"), filepath.Join(src, "testdata", "fp_target.c"), "-ldl", "-lpthread"},
		}
		if buildErr = os.MkdirAll(filepath.Join(buildDir, "lib"), 0o755); buildErr != nil {
			return
		}
		for _, s := range steps {
			if out, err := exec.Command(s[0], s[1:]...).CombinedOutput(); err != nil {
				buildErr = fmt.Errorf("%v: %v\n%s", s, err, out)
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return buildDir
}

// Run runs the tests of m, then removes what Build built, and exits.
func Run(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// Region is one of the target's regions of device memory: its name, its
// address and size.
type Region struct {
	Name string
	VA   uint64
	Size int
}

// Target is a running fp_target with the library preloaded.
type Target struct {
	PID     int
	Dir     string // its files
	SockDir string // its control socket's directory (GPUCR_PRELOAD_DIR)
	Out     string // its stdout and stderr
	Regions []Region
	Cmd     *exec.Cmd
	// Marked: its KV cache was stored as a cache (nothing), so it holds
	// zeros after a restore.
	Marked bool
}

// Start starts a Target with env added to its environment.
func Start(t testing.TB, env ...string) *Target {
	t.Helper()
	return StartWrapped(t, nil, env...)
}

// StartWrapped starts the Target through wrap (a command that runs its
// arguments in a child: the Target is its only child), if not nil.
func StartWrapped(t testing.TB, wrap []string, env ...string) *Target {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("linux only")
	}
	b := Build(t)
	// A short path: sun_path is 108 bytes.
	base, err := os.MkdirTemp("", "fp")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	tg := &Target{Dir: filepath.Join(base, "d"), SockDir: filepath.Join(base, "run")}
	os.Mkdir(tg.Dir, 0o755)
	args := append(append([]string{}, wrap...), filepath.Join(b, "fp_target"), tg.Dir)
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = append(os.Environ(), "LD_PRELOAD="+filepath.Join(b, preloadctl.Library), "LD_LIBRARY_PATH="+filepath.Join(b, "lib"),
		"GPUCR_PRELOAD_DIR="+tg.SockDir)
	cmd.Env = append(cmd.Env, env...)
	// Its output in a file: the library speaks on its stderr.
	out, err := os.Create(filepath.Join(base, "out"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	tg.Out = out.Name()
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	tg.Cmd, tg.PID = cmd, cmd.Process.Pid
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if wrap != nil {
		// The Target is the wrapper's child.
		for end := time.Now().Add(testwait.Scale(10 * time.Second)); ; time.Sleep(5 * time.Millisecond) {
			b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", tg.PID, tg.PID))
			if f := strings.Fields(string(b)); len(f) == 1 {
				tg.PID, _ = strconv.Atoi(f[0])
				t.Cleanup(func() { syscall.Kill(tg.PID, syscall.SIGKILL) })
				break
			}
			if time.Now().After(end) {
				t.Fatalf("%v started no child", wrap)
			}
		}
	}
	deadline := time.Now().Add(testwait.Scale(10 * time.Second))
	for {
		if _, err := os.Stat(filepath.Join(tg.Dir, "ready")); err == nil {
			break
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(tg.Out)
			t.Fatalf("Target not ready: %s", b)
		}
		time.Sleep(5 * time.Millisecond)
	}
	b2, err := os.ReadFile(filepath.Join(tg.Dir, "addrs"))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(strings.TrimSpace(string(b2)), "\n") {
		f := strings.Fields(l)
		va, _ := strconv.ParseUint(f[1], 10, 64)
		n, _ := strconv.Atoi(f[2])
		tg.Regions = append(tg.Regions, Region{f[0], va, n})
	}
	return tg
}

// Check asks the Target to read its memory back; "" if it does not answer
// within wait (it is parked).
func (tg *Target) Check(t testing.TB, wait time.Duration) string {
	t.Helper()
	res := filepath.Join(tg.Dir, "result")
	os.Remove(res)
	if err := os.WriteFile(filepath.Join(tg.Dir, "check"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(wait)
	for time.Now().Before(deadline) {
		if b, err := os.ReadFile(res); err == nil {
			return strings.TrimSpace(string(b))
		}
		time.Sleep(5 * time.Millisecond)
	}
	return ""
}

// OpenTempDir is a fresh directory, held open (what scratch space is
// handed to Peek and HashDevice as), closed when the test ends.
func OpenTempDir(t testing.TB) *os.File {
	t.Helper()
	dir, err := os.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dir.Close() })
	return dir
}

// Rewrite has the Target write its Region name with its next pattern
// (which its check then expects), and returns the Region.
func (tg *Target) Rewrite(t testing.TB, name string) Region {
	t.Helper()
	k := slices.IndexFunc(tg.Regions, func(r Region) bool { return r.Name == name })
	if k < 0 {
		t.Fatalf("the Target has no Region %s", name)
	}
	os.Remove(filepath.Join(tg.Dir, "rewritten"))
	tmp := filepath.Join(tg.Dir, "rewrite.tmp")
	if err := os.WriteFile(tmp, []byte{byte('0' + k), '\n'}, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(tg.Dir, "rewrite")); err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(testwait.Scale(5 * time.Second)); ; time.Sleep(5 * time.Millisecond) {
		if _, err := os.Stat(filepath.Join(tg.Dir, "rewritten")); err == nil {
			return tg.Regions[k]
		}
		if time.Now().After(end) {
			t.Fatal("Target did not rewrite its Region")
		}
	}
}

// MustBeIntact fails the test unless the Target reads its memory back as
// it wrote it.
func (tg *Target) MustBeIntact(t testing.TB) {
	t.Helper()
	if r := tg.Check(t, 5*time.Second); !strings.HasPrefix(r, "ok ") {
		t.Fatalf("Target's memory after the round: %q", r)
	}
}

// Report is what the Target's library says of it (a connection of its
// own: one held elsewhere makes it wait).
func (tg *Target) Report(t testing.TB) preloadctl.Report {
	t.Helper()
	p, err := preloadctl.Dial(context.Background(), tg.SockDir, tg.PID)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	r, err := p.Report(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// Store holds the files put into a "checkpoint".
type Store struct {
	Mu    sync.Mutex
	Files map[string][]byte
	// Tables are the handle tables put (vram-PID.handles), kept apart
	// from the VRAM files.
	Tables map[string][]byte
	// FailAfter: a put fails after reading that many bytes, or at the
	// end of a shorter file (-1: never).
	FailAfter int64
	// Block, if not nil, holds every put until it is closed (or the
	// store is cancelled).
	Block chan struct{}
}

// NewStore is an empty store that never fails.
func NewStore() *Store {
	return &Store{Files: map[string][]byte{}, Tables: map[string][]byte{}, FailAfter: -1}
}

func (m *Store) mapOf(name string) map[string][]byte {
	if strings.HasSuffix(name, ".handles") {
		return m.Tables
	}
	return m.Files
}

// Put stores a file (a vram.PutFunc).
func (m *Store) Put(ctx context.Context, name string, r io.Reader) error {
	if m.Block != nil {
		select {
		case <-m.Block:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
	var b bytes.Buffer
	if m.FailAfter >= 0 {
		// A file shorter than failAfter fails at its end: which file's
		// error comes first is up to the scheduler.
		if _, err := io.CopyN(&b, r, m.FailAfter); err != nil && !errors.Is(err, io.EOF) {
			return err
		}
		return errors.New("injected destination failure")
	}
	if _, err := io.Copy(&b, r); err != nil {
		return err
	}
	m.Mu.Lock()
	m.mapOf(name)[name] = b.Bytes()
	m.Mu.Unlock()
	return nil
}

// Get copies a stored file into w (a vram.GetFunc).
func (m *Store) Get(ctx context.Context, name string, w io.Writer) error {
	m.Mu.Lock()
	b, ok := m.mapOf(name)[name]
	m.Mu.Unlock()
	if !ok {
		return fmt.Errorf("%s: not stored", name)
	}
	_, err := w.Write(b)
	return err
}

// Pat is Region k's byte i as preload/testdata/fp_target.c writes it.
func Pat(k, i int) byte {
	h := uint64(i)*0x9E3779B97F4A7C15 ^ uint64(k+1)*0xC2B2AE3D27D4EB4F
	h ^= h >> 29
	h *= 0xBF58476D1CE4E5B9
	h ^= h >> 32
	return byte(h >> 24)
}

// CheckRecords parses the stored VRAM files (docs/PRODUCERS.md) and checks
// that every Region of the Target is in them with its pattern.
func CheckRecords(t testing.TB, tg *Target, files map[string][]byte) {
	t.Helper()
	got := map[uint64][]byte{}
	for name, b := range files {
		for _, r := range ParseRecords(t, name, b) {
			got[r.VA] = PieceBytes(b, r)
		}
	}
	for k, r := range tg.Regions {
		if r.Name == "counter" {
			continue
		}
		for i := 0; i < r.Size; i++ {
			// Ranges are split into pieces; find the one holding byte i.
			va := r.VA + uint64(i)
			var piece []byte
			var base uint64
			for s, b := range got {
				if va >= s && va < s+uint64(len(b)) {
					piece, base = b, s
					break
				}
			}
			if piece == nil {
				t.Fatalf("Region %s byte %d (%#x) is in no record", r.Name, i, va)
			}
			end := min(r.Size, i+len(piece)-int(va-base))
			for ; i < end; i++ {
				if c := piece[r.VA+uint64(i)-base]; c != tg.Want(k, i) {
					t.Fatalf("Region %s byte %d: %d, want %d", r.Name, i, c, tg.Want(k, i))
				}
			}
			i--
		}
	}
}

// ZBlock is the library's zero-scan block.
const ZBlock = 64 << 10

// KVWritten: the Target's KV block b (32 KiB) its "requests" wrote
// (fp_target.c, kv_written).
func KVWritten(b int) bool {
	return (b >= 1 && b <= 3) || b == 40 || (b >= 100 && b < 108) || b == 8<<20/(32<<10)-1
}

// Want is Region k's byte i as the Target's check expects it.
func (tg *Target) Want(k, i int) byte {
	if tg.Regions[k].Name == "kv" && (tg.Marked || !KVWritten(i/(32<<10))) {
		return 0
	}
	return Pat(k, i)
}

// KVBlocks are the 64 KiB blocks of the KV cache that hold anything.
func KVBlocks() int64 {
	var n int64
	for b := 0; b < 8<<20/ZBlock; b++ {
		if KVWritten(2*b) || KVWritten(2*b+1) {
			n++
		}
	}
	return n
}

// Written is what the zero scan should find written of tg's device
// memory: every block of its regions (filled with a pattern), the
// counter's, and the KV cache's written blocks; with poison, every block
// of its allocations but the KV cache's unwritten ones (the rest of each
// allocation is 0xA5).
func (tg *Target) Written(t testing.TB, poison bool) int64 {
	t.Helper()
	if poison {
		return tg.Report(t).Bytes - (8<<20/ZBlock-KVBlocks())*ZBlock
	}
	var n int64
	for _, r := range tg.Regions {
		switch r.Name {
		case "imported": // another allocation's memory
		case "kv":
			n += KVBlocks() * ZBlock
		default:
			n += (int64(r.Size) + ZBlock - 1) / ZBlock * ZBlock
		}
	}
	return n
}

// Record is one record of a VRAM file: a piece of device memory at va
// of n bytes, its stored blocks' data bytes from off in the file; block
// and unstored (a bitmap, bit set: not stored) say which blocks those are
// (GPUCRVM3; before, every byte is stored).
type Record struct {
	VA, N, Block, Cached uint64
	Unstored             string
	Off, Data            int
}

// Stored says whether block k of r is in the file.
func (r Record) Stored(k uint64) bool {
	return r.Unstored == "" || r.Unstored[k/8]&(1<<(k%8)) == 0
}

// ParseRecords parses a VRAM file (docs/PRODUCERS.md): GPUCRVM3, each
// record's header (va, size, block, cached) and bitmap, then zeros to a 4
// KiB boundary, then the stored blocks; GPUCRVM2, every byte at the next
// 4 KiB boundary after a header of va and size; GPUCRVM1, right after it.
func ParseRecords(t testing.TB, name string, b []byte) []Record {
	t.Helper()
	if len(b) < 8 || (string(b[:8]) != "GPUCRVM3" && string(b[:8]) != "GPUCRVM2" && string(b[:8]) != "GPUCRVM1") {
		t.Fatalf("%s: no magic", name)
	}
	v := int(b[7] - '0')
	hn := map[bool]int{true: 32, false: 16}[v == 3]
	var rs []Record
	for off := 8; ; {
		if len(b)-off < hn {
			t.Fatalf("%s: truncated at %d", name, off)
		}
		r := Record{VA: binary.LittleEndian.Uint64(b[off:]), N: binary.LittleEndian.Uint64(b[off+8:])}
		r.Block = r.N
		if v == 3 {
			r.Block, r.Cached = binary.LittleEndian.Uint64(b[off+16:]), binary.LittleEndian.Uint64(b[off+24:])
		}
		off += hn
		if r.VA == 0 && r.N == 0 {
			if off != len(b) {
				t.Fatalf("%s: %d bytes after the end record", name, len(b)-off)
			}
			return rs
		}
		nblk := (r.N + r.Block - 1) / r.Block
		if v == 3 {
			bl := int(nblk+7) / 8
			r.Unstored = string(b[off : off+bl])
			off += bl
		}
		if v > 1 && off%4096 != 0 {
			pad := 4096 - off%4096
			if len(b)-off < pad || !bytes.Equal(b[off:off+pad], make([]byte, pad)) {
				t.Fatalf("%s: padding at %d before record %#x not zeros", name, off, r.VA)
			}
			off += pad
		}
		r.Off = off
		for k := uint64(0); k < nblk; k++ {
			if r.Stored(k) {
				r.Data += int(min(r.Block, r.N-k*r.Block))
			}
		}
		if len(b)-off < r.Data {
			t.Fatalf("%s: record %#x+%d truncated", name, r.VA, r.N)
		}
		rs = append(rs, r)
		off += r.Data
	}
}

// PieceBytes is the device memory record r of file b stands for: its
// stored blocks, zeros for the others.
func PieceBytes(b []byte, r Record) []byte {
	out := make([]byte, r.N)
	at := r.Off
	for k := uint64(0); k*r.Block < r.N; k++ {
		n := min(r.Block, r.N-k*r.Block)
		if r.Stored(k) {
			copy(out[k*r.Block:], b[at:at+int(n)])
			at += int(n)
		}
	}
	return out
}

// MustRoot skips the test unless it runs as root (in CI, fails it).
func MustRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI runs the tests as root")
		}
		t.Skip("needs root")
	}
}

// MustSize is the size of the file at path.
func MustSize(t testing.TB, path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}

// Collectives holds the Target's collectives for a moment and tells how
// many it launched (the hold ends with the connection).
func (tg *Target) Collectives(t testing.TB) int64 {
	t.Helper()
	p, err := preloadctl.Dial(context.Background(), tg.SockDir, tg.PID)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	time.Sleep(30 * time.Millisecond)
	n, err := p.CollectivesHold(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return n
}
