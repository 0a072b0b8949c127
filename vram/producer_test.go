package vram

import (
	"bytes"
	"context"
	"debug/elf"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/preloadctl"
	"golang.org/x/sys/unix"
)

// These tests run libgpucr-preload against a fake driver (preload/testdata/
// fake_cuda.c: host memory behind the driver's entry points) in a test
// program that reaches the driver the way the CUDA runtime does
// (preload/testdata/fp_target.c). They need a C compiler: in CI (CI=true)
// its absence fails them.

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

func buildPreload(t testing.TB) string {
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
		src := filepath.Join("..", "preload")
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

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// TestPreloadExportsOnlyTheDriver: the library's files share their helpers
// hidden (preload/internal.h), so a program binds to the driver's entry
// points and dlsym in it, and to the two functions it offers programs
// (gpucr_mark_cache, gpucr_unmark_cache), never to another of its names.
func TestPreloadExportsOnlyTheDriver(t *testing.T) {
	f, err := elf.Open(filepath.Join(buildPreload(t), preloadctl.Library))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	syms, err := f.DynamicSymbols()
	if err != nil {
		t.Fatal(err)
	}
	driver := regexp.MustCompile(`^(cu[A-Z]\w*|gpucr_(un)?mark_cache)$`)
	have := map[string]bool{}
	for _, s := range syms {
		if bind := elf.ST_BIND(s.Info); s.Section == elf.SHN_UNDEF || (bind != elf.STB_GLOBAL && bind != elf.STB_WEAK) {
			continue
		}
		have[s.Name] = true
		if s.Name != "dlsym" && !driver.MatchString(s.Name) {
			t.Errorf("the library exports %s, not a driver entry point nor its own interface", s.Name)
		}
	}
	for _, name := range []string{"dlsym", "cuGetProcAddress_v2", "cuMemAlloc_v2", "cuMemMap", "cuLaunchKernel", "cuMemAllocManaged", "gpucr_mark_cache", "gpucr_unmark_cache"} {
		if !have[name] {
			t.Errorf("the library does not export %s", name)
		}
	}
}

type region struct {
	name string
	va   uint64
	size int
}

// target is a running fp_target with the library preloaded.
type target struct {
	pid     int
	dir     string // its files
	sockDir string
	out     string // its stdout and stderr
	regions []region
	cmd     *exec.Cmd
	// marked: its KV cache was stored as a cache (nothing), so it holds
	// zeros after a restore.
	marked bool
}

func startTarget(t testing.TB, env ...string) *target {
	t.Helper()
	return startWrapped(t, nil, env...)
}

// startWrapped starts the target through wrap (a command that runs its
// arguments in a child: the target is its only child), if not nil.
func startWrapped(t testing.TB, wrap []string, env ...string) *target {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("linux only")
	}
	b := buildPreload(t)
	// A short path: sun_path is 108 bytes.
	base, err := os.MkdirTemp("", "fp")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	tg := &target{dir: filepath.Join(base, "d"), sockDir: filepath.Join(base, "run")}
	os.Mkdir(tg.dir, 0o755)
	args := append(append([]string{}, wrap...), filepath.Join(b, "fp_target"), tg.dir)
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = append(os.Environ(), "LD_PRELOAD="+filepath.Join(b, preloadctl.Library), "LD_LIBRARY_PATH="+filepath.Join(b, "lib"),
		"GPUCR_PRELOAD_DIR="+tg.sockDir)
	cmd.Env = append(cmd.Env, env...)
	// Its output in a file: the library speaks on its stderr.
	out, err := os.Create(filepath.Join(base, "out"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	tg.out = out.Name()
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	tg.cmd, tg.pid = cmd, cmd.Process.Pid
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if wrap != nil {
		// The target is the wrapper's child.
		for end := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", tg.pid, tg.pid))
			if f := strings.Fields(string(b)); len(f) == 1 {
				tg.pid, _ = strconv.Atoi(f[0])
				t.Cleanup(func() { syscall.Kill(tg.pid, syscall.SIGKILL) })
				break
			}
			if time.Now().After(end) {
				t.Fatalf("%v started no child", wrap)
			}
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(filepath.Join(tg.dir, "ready")); err == nil {
			break
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(tg.out)
			t.Fatalf("target not ready: %s", b)
		}
		time.Sleep(5 * time.Millisecond)
	}
	b2, err := os.ReadFile(filepath.Join(tg.dir, "addrs"))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(strings.TrimSpace(string(b2)), "\n") {
		f := strings.Fields(l)
		va, _ := strconv.ParseUint(f[1], 10, 64)
		n, _ := strconv.Atoi(f[2])
		tg.regions = append(tg.regions, region{f[0], va, n})
	}
	return tg
}

// check asks the target to read its memory back; "" if it does not answer
// within wait (it is parked).
func (tg *target) check(t *testing.T, wait time.Duration) string {
	t.Helper()
	res := filepath.Join(tg.dir, "result")
	os.Remove(res)
	if err := os.WriteFile(filepath.Join(tg.dir, "check"), nil, 0o644); err != nil {
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

// openTempDir is a fresh directory, held open (what scratch space is
// handed to Peek and HashDevice as), closed when the test ends.
func openTempDir(t *testing.T) *os.File {
	t.Helper()
	dir, err := os.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dir.Close() })
	return dir
}

// rewrite has the target write its region name with its next pattern
// (which its check then expects), and returns the region.
func (tg *target) rewrite(t *testing.T, name string) region {
	t.Helper()
	k := slices.IndexFunc(tg.regions, func(r region) bool { return r.name == name })
	if k < 0 {
		t.Fatalf("the target has no region %s", name)
	}
	os.Remove(filepath.Join(tg.dir, "rewritten"))
	tmp := filepath.Join(tg.dir, "rewrite.tmp")
	if err := os.WriteFile(tmp, []byte{byte('0' + k), '\n'}, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(tg.dir, "rewrite")); err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if _, err := os.Stat(filepath.Join(tg.dir, "rewritten")); err == nil {
			return tg.regions[k]
		}
		if time.Now().After(end) {
			t.Fatal("target did not rewrite its region")
		}
	}
}

func (tg *target) mustBeIntact(t *testing.T) {
	t.Helper()
	if r := tg.check(t, 5*time.Second); !strings.HasPrefix(r, "ok ") {
		t.Fatalf("target's memory after the round: %q", r)
	}
}

func (tg *target) report(t testing.TB) preloadctl.Report {
	t.Helper()
	p, err := preloadctl.Dial(context.Background(), tg.sockDir, tg.pid)
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

// memStore holds the files put into a "checkpoint".
type memStore struct {
	mu    sync.Mutex
	files map[string][]byte
	// failAfter: a put fails after reading that many bytes, or at the
	// end of a shorter file (-1: never).
	failAfter int64
	// block, if not nil, holds every put until it is closed (or the
	// store is cancelled).
	block chan struct{}
}

func newStore() *memStore { return &memStore{files: map[string][]byte{}, failAfter: -1} }

func (m *memStore) put(ctx context.Context, name string, r io.Reader) error {
	if m.block != nil {
		select {
		case <-m.block:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
	var b bytes.Buffer
	if m.failAfter >= 0 {
		// A file shorter than failAfter fails at its end: which file's
		// error comes first is up to the scheduler.
		if _, err := io.CopyN(&b, r, m.failAfter); err != nil && !errors.Is(err, io.EOF) {
			return err
		}
		return errors.New("injected destination failure")
	}
	if _, err := io.Copy(&b, r); err != nil {
		return err
	}
	m.mu.Lock()
	m.files[name] = b.Bytes()
	m.mu.Unlock()
	return nil
}

func (m *memStore) get(ctx context.Context, name string, w io.Writer) error {
	m.mu.Lock()
	b, ok := m.files[name]
	m.mu.Unlock()
	if !ok {
		return fmt.Errorf("%s: not stored", name)
	}
	_, err := w.Write(b)
	return err
}

// pat is region k's byte i as preload/testdata/fp_target.c writes it.
func pat(k, i int) byte {
	h := uint64(i)*0x9E3779B97F4A7C15 ^ uint64(k+1)*0xC2B2AE3D27D4EB4F
	h ^= h >> 29
	h *= 0xBF58476D1CE4E5B9
	h ^= h >> 32
	return byte(h >> 24)
}

// checkRecords parses the stored VRAM files (docs/PRODUCERS.md) and checks
// that every region of the target is in them with its pattern.
func checkRecords(t *testing.T, tg *target, files map[string][]byte) {
	t.Helper()
	got := map[uint64][]byte{}
	for name, b := range files {
		for _, r := range parseRecords(t, name, b) {
			got[r.va] = pieceBytes(b, r)
		}
	}
	for k, r := range tg.regions {
		if r.name == "counter" {
			continue
		}
		for i := 0; i < r.size; i++ {
			// Ranges are split into pieces; find the one holding byte i.
			va := r.va + uint64(i)
			var piece []byte
			var base uint64
			for s, b := range got {
				if va >= s && va < s+uint64(len(b)) {
					piece, base = b, s
					break
				}
			}
			if piece == nil {
				t.Fatalf("region %s byte %d (%#x) is in no record", r.name, i, va)
			}
			end := min(r.size, i+len(piece)-int(va-base))
			for ; i < end; i++ {
				if c := piece[r.va+uint64(i)-base]; c != tg.want(k, i) {
					t.Fatalf("region %s byte %d: %d, want %d", r.name, i, c, tg.want(k, i))
				}
			}
			i--
		}
	}
}

func fastOpts(tg *target, t testing.TB) FastOptions {
	return FastOptions{Dir: tg.sockDir, Files: 3, ParkTimeout: 5 * time.Second, KeepDir: filepath.Join(t.TempDir(), "keep"),
		Records: filepath.Join(t.TempDir(), "kept")}
}

// fastSuspended moves tg's device memory into a new store and commits;
// with detach the library is detached and waited for first, as a
// checkpoint does between its copy and its commit.
func fastSuspended(tb testing.TB, tg *target, detach bool) (*memStore, *FastSuspension) {
	tb.Helper()
	ctx := context.Background()
	st := newStore()
	s, err := FastSuspend(ctx, []int{tg.pid}, st.put, fastOpts(tg, tb))
	if err != nil {
		tb.Fatal(err)
	}
	if detach {
		if err := s.Detach(ctx); err != nil {
			tb.Fatal(err)
		}
		if err := s.Wait(ctx); err != nil {
			tb.Fatal(err)
		}
	}
	s.Commit()
	return st, s
}

// keptPaths are the paths of the kept files of s's i-th process.
func keptPaths(s *FastSuspension, i int) []string {
	var ps []string
	for _, name := range s.procs[i].Files {
		ps = append(ps, filepath.Join(s.opts.KeepDir, name))
	}
	return ps
}

func TestFastPathRoundTrip(t *testing.T) {
	tg := startTarget(t)
	ctx := context.Background()
	fi, err := os.Stat(tg.sockDir)
	if err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("socket directory: %v %v, want mode 0700", fi.Mode(), err)
	}
	si, err := os.Stat(preloadctl.Socket(tg.sockDir, tg.pid))
	if err != nil || si.Mode().Perm() != 0o600 {
		t.Fatalf("socket: %v %v, want mode 0600", si.Mode(), err)
	}
	reps, err := FastCheck(ctx, tg.sockDir, []int{tg.pid})
	if err != nil {
		t.Fatal(err)
	}
	before := reps[0]
	var want int64
	for _, r := range tg.regions {
		want += int64(r.size)
	}
	// Allocations are rounded up to the granularity: at least the regions.
	if before.Bytes < want || before.Allocs != 4 || before.Mappings != 6 || before.DeviceUsed == 0 {
		t.Fatalf("report before: %+v (regions %d bytes)", before, want)
	}
	st := newStore()
	st.block = make(chan struct{})
	o := fastOpts(tg, t)
	s, err := FastSuspend(ctx, []int{tg.pid}, st.put, o)
	if err != nil {
		t.Fatal(err)
	}
	// The device is free while nothing is stored yet: the library wrote
	// the kept copy, the store reads it after the release.
	if r, err := s.procs[0].p.Report(ctx); err != nil || !r.Parked || !r.Released || r.DeviceUsed != 0 || len(r.Kept) != 3 || r.Staged != 0 {
		t.Fatalf("report after the release: %+v %v, want parked, released, no device memory in use, 3 kept files, no pinned buffers left", r, err)
	}
	// Every copy thread took the buffers staged before the park, and
	// copied what the program wrote.
	written := tg.written(t, false)
	if c := s.Timings.Copy; c.Workers != 3 || c.Staged != 3 || c.Bytes != written || c.Allocated != before.Bytes || c.Work <= 0 {
		t.Fatalf("copy out: %+v, want 3 workers on staged buffers copying %d bytes of %d", c, written, before.Bytes)
	}
	st.mu.Lock()
	stored := len(st.files)
	st.mu.Unlock()
	if stored != 0 {
		t.Fatalf("%d files stored before the store was let go", stored)
	}
	kept := map[string][]byte{}
	for i, k := range keptPaths(s, 0) {
		if fi, err := os.Stat(k); err != nil || fi.Mode().Perm() != 0o600 {
			t.Fatalf("kept file %s: %v %v, want mode 0600", k, fi, err)
		}
		b, err := os.ReadFile(k)
		if err != nil {
			t.Fatal(err)
		}
		kept[s.procs[0].Files[i]] = b
	}
	checkRecords(t, tg, kept)
	close(st.block)
	if err := s.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if s.Bytes() != written || len(st.files) != 3 || s.Timings.Store <= 0 {
		t.Fatalf("copied %d bytes into %d files (store %v), want %d into 3", s.Bytes(), len(st.files), s.Timings.Store, written)
	}
	for name, b := range kept {
		if !bytes.Equal(st.files[name], b) {
			t.Fatalf("%s: stored %d bytes that are not the kept copy's %d", name, len(st.files[name]), len(b))
		}
	}
	if r := tg.check(t, 200*time.Millisecond); r != "" {
		t.Fatalf("a parked target answered: %q", r)
	}
	s.Commit()
	if ents, _ := os.ReadDir(o.KeepDir); len(ents) != 0 {
		t.Fatalf("kept copy left after the commit: %d files", len(ents))
	}
	procs := s.Procs()
	if len(procs) != 1 || procs[0].PID != tg.pid || len(procs[0].Files) != 3 {
		t.Fatalf("procs %+v", procs)
	}
	if _, _, cs, err := FastResume(ctx, tg.sockDir, tg.pid, procs[0].Files, st.get, nil); err != nil || cs.Bytes != written || cs.Zero != before.Bytes-written {
		t.Fatalf("resume: %d bytes, %v", cs.Bytes, err)
	}
	// Same addresses (the target reads back through its own pointers), same
	// bytes, and the kernel thread's counter matches its launches.
	tg.mustBeIntact(t)
	if r := tg.report(t); r.Parked || r.Released || r.DeviceUsed != before.DeviceUsed {
		t.Fatalf("report after resume: %+v", r)
	}
}

// TestStageFreed: staged pinned buffers that no copy takes are freed at
// unpark and when the connection that staged them ends (pinned host memory
// at the driver's checkpoint would go into the dump), with buffers the
// library maps and registers and with cuMemHostAlloc's where the driver
// cannot register.
func TestStageFreed(t *testing.T) {
	for _, env := range [][]string{nil, {"GPUCR_FAKE_NO_REGISTER=1"}} {
		t.Run(fmt.Sprint("env=", env), func(t *testing.T) { testStageFreed(t, env) })
	}
}

func testStageFreed(t *testing.T, env []string) {
	tg := startTarget(t, env...)
	ctx := context.Background()
	staged := func() int {
		p, err := preloadctl.Dial(ctx, tg.sockDir, tg.pid)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		r, err := p.Report(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return r.Staged
	}
	for _, end := range []string{"unpark", "close"} {
		p, err := preloadctl.Dial(ctx, tg.sockDir, tg.pid)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Stage(ctx, 4); err != nil {
			t.Fatal(err)
		}
		if r, err := p.Report(ctx); err != nil || r.Staged != 4 {
			t.Fatalf("%s: after stage 4: %+v %v", end, r, err)
		}
		if end == "unpark" {
			if err := p.Park(ctx, time.Second); err != nil {
				t.Fatal(err)
			}
			if err := p.Unpark(ctx); err != nil {
				t.Fatal(err)
			}
			if r, err := p.Report(ctx); err != nil || r.Staged != 0 {
				t.Fatalf("after unpark: %d staged (%v), want 0", r.Staged, err)
			}
		}
		p.Close()
		if n := staged(); n != 0 {
			t.Fatalf("%s: %d copy threads' buffers still staged, want 0", end, n)
		}
	}
	if err := func() error {
		p, err := preloadctl.Dial(ctx, tg.sockDir, tg.pid)
		if err != nil {
			return err
		}
		defer p.Close()
		return p.Stage(ctx, 65)
	}(); err == nil || !strings.Contains(err.Error(), "want 1..64") {
		t.Fatalf("stage 65: %v, want refused", err)
	}
	// A whole round on them.
	st, s := fastSuspended(t, tg, true)
	if c := s.Timings.Copy; c.Staged != 3 {
		t.Fatalf("copy out: %+v, want 3 workers on staged buffers", c)
	}
	if _, _, cs, err := FastResume(ctx, tg.sockDir, tg.pid, s.Procs()[0].Files, st.get, nil); err != nil || cs.Bytes != s.Bytes() {
		t.Fatalf("resume: %+v %v", cs, err)
	}
	tg.mustBeIntact(t)
}

func TestFastPathFaults(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name, fault string
		failAfter   int64 // a put fails (-1: none)
		full        bool  // the kept copy's file system is full (ENOSPC)
		planted     bool  // a kept file's name is a symlink planted to a file of root's
		wantSuspend bool  // FastSuspend succeeds
		wantStore   bool  // and its store too
		want        string
	}{
		{"park", "park", -1, false, false, false, false, "injected"},
		{"copy out", "copyout", -1, false, false, false, false, "injected"},
		{"no space for the kept copy", "", -1, true, false, false, false, "not enough room"},
		{"planted symlink", "", -1, false, true, false, false, "file exists"},
		{"release", "release", -1, false, false, false, false, "injected"},
		{"store after release", "", 1 << 20, false, false, true, false, "injected destination failure"},
		{"store fails at once", "", 0, false, false, true, false, "injected destination failure"},
		{"after release", "", -1, false, false, true, true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var env []string
			if tc.fault != "" {
				env = append(env, "GPUCR_PRELOAD_FAULT="+tc.fault)
			}
			tg := startTarget(t, env...)
			used := tg.report(t).DeviceUsed
			st := newStore()
			st.failAfter = tc.failAfter
			o := fastOpts(tg, t)
			if tc.full {
				// The file system fills up under the library's writes.
				mustRoot(t)
				if err := os.MkdirAll(o.KeepDir, 0o700); err != nil {
					t.Fatal(err)
				}
				if err := unix.Mount("full", o.KeepDir, "tmpfs", 0, "size=64k,mode=0700"); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { unix.Unmount(o.KeepDir, unix.MNT_DETACH) })
			}
			// Issue 25 H1: whoever may write into the kept copy's
			// directory plants a symlink to a file of root's in place of
			// a kept file: it is neither truncated nor handed over.
			victim := filepath.Join(t.TempDir(), "root-only")
			if tc.planted {
				if err := os.WriteFile(victim, []byte("root's"), 0o600); err != nil {
					t.Fatal(err)
				}
				if err := os.MkdirAll(o.KeepDir, 0o700); err != nil {
					t.Fatal(err)
				}
				link := filepath.Join(o.KeepDir, fmt.Sprintf("vram-%d-01.bin", tg.pid))
				if err := os.Symlink(victim, link); err != nil {
					t.Fatal(err)
				}
				defer func() {
					if b, err := os.ReadFile(victim); err != nil || string(b) != "root's" {
						t.Errorf("the planted symlink's target: %q %v, want it untouched", b, err)
					}
				}()
				defer os.Remove(link)
			}
			s, err := FastSuspend(ctx, []int{tg.pid}, st.put, o)
			if (err == nil) != tc.wantSuspend {
				t.Fatalf("suspend: %v", err)
			}
			if err == nil {
				// The owning connection is still held: ask through it.
				if r, err := s.procs[0].p.Report(ctx); err != nil || !r.Released || len(r.Kept) != 3 {
					t.Fatalf("not released with a kept copy of 3 files: %+v %v", r, err)
				}
				err = s.Wait(ctx)
				if (err == nil) != tc.wantStore {
					t.Fatalf("store: %v", err)
				}
				// What follows the release failed (the store, CRIU, the
				// driver, the commit): the undo refills from the kept copy.
				if uerr := s.Undo(ctx); uerr != nil {
					t.Fatal(uerr)
				}
			}
			if tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
			tg.mustBeIntact(t)
			r := tg.report(t)
			if r.Parked || r.Released || r.DeviceUsed != used {
				t.Fatalf("after the undo: %+v, want running with %d bytes of device memory", r, used)
			}
			if ents, _ := os.ReadDir(o.KeepDir); len(ents) != map[bool]int{true: 1}[tc.planted] {
				t.Fatalf("kept copy left behind: %d files", len(ents))
			}
		})
	}
}

func mustRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI runs the tests as root")
		}
		t.Skip("needs root")
	}
}

// An undo while the store is held up (a destination that stalls) stops
// the store and refills at once.
func TestFastPathUndoStalledStore(t *testing.T) {
	ctx := context.Background()
	tg := startTarget(t)
	st := newStore()
	st.block = make(chan struct{}) // never let go
	o := fastOpts(tg, t)
	s, err := FastSuspend(ctx, []int{tg.pid}, st.put, o)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Undo(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(ctx); !errors.Is(err, errUndone) {
		t.Fatalf("store after the undo: %v, want %v", err, errUndone)
	}
	tg.mustBeIntact(t)
	if ents, _ := os.ReadDir(o.KeepDir); len(ents) != 0 {
		t.Fatalf("kept copy left behind: %d files", len(ents))
	}
}

// A failed copy-in (or remap) on restore leaves the process parked; a
// retry completes it.
func TestFastResumeFaults(t *testing.T) {
	ctx := context.Background()
	for _, fault := range []string{"remap", "copyin"} {
		t.Run(fault, func(t *testing.T) {
			tg := startTarget(t, "GPUCR_PRELOAD_FAULT="+fault)
			st, s := fastSuspended(t, tg, false)
			files := s.Procs()[0].Files
			if _, _, _, err := FastResume(ctx, tg.sockDir, tg.pid, files, st.get, nil); err == nil || !strings.Contains(err.Error(), "injected") {
				t.Fatalf("resume with a %s fault: %v", fault, err)
			}
			if r := tg.check(t, 200*time.Millisecond); r != "" {
				t.Fatalf("the target ran after a failed resume: %q", r)
			}
			if _, _, _, err := FastResume(ctx, tg.sockDir, tg.pid, files, st.get, nil); err != nil {
				t.Fatal(err)
			}
			tg.mustBeIntact(t)
		})
	}
}

// Copy-in takes only well-formed files whose ranges are mappings of the
// process; anything else fails and the process stays parked.
func TestFastResumeBadFiles(t *testing.T) {
	ctx := context.Background()
	tg := startTarget(t)
	st, s := fastSuspended(t, tg, false)
	files := s.Procs()[0].Files
	good := map[string][]byte{}
	for k, v := range st.files {
		good[k] = v
	}
	// The file with the most ranges.
	f0 := files[0]
	for _, f := range files {
		if len(good[f]) > len(good[f0]) {
			f0 = f
		}
	}
	g0 := good[f0]
	rec := func(va, n uint64) []byte {
		b := binary.LittleEndian.AppendUint64(nil, va)
		return binary.LittleEndian.AppendUint64(b, n)
	}
	rs := parseRecords(t, f0, g0)
	r0 := rs[0]
	// rd is the first record with data; rz its header's end (bitmap
	// included), where its padding starts.
	rd := rs[slices.IndexFunc(rs, func(r vramRecord) bool { return r.data > 0 })]
	rz := r0.off - 4096 + 8 + 32 + len(r0.unstored)
	if r0.off != 4096 {
		t.Fatalf("first record's data at %d, want 4096", r0.off)
	}
	// v3rec appends to f a GPUCRVM3 record of r with the block, cached
	// and bitmap given, padded to a page, and data.
	v3rec := func(f []byte, r vramRecord, block, cached uint64, bm []byte, data []byte) []byte {
		f = append(append(append(f, rec(r.va, r.n)...), rec(block, cached)...), bm...)
		return append(append(f, make([]byte, (4096-len(f)%4096)%4096)...), data...)
	}
	// one is a file of one GPUCRVM3 record of r0 (the others missing).
	one := func(block, cached uint64, bm []byte) []byte {
		return append(v3rec([]byte("GPUCRVM3"), r0, block, cached, bm, nil), make([]byte, 32)...)
	}
	// The first piece again before the end record.
	twice := v3rec(append([]byte{}, g0[:len(g0)-32]...), r0, r0.block, r0.cached, []byte(r0.unstored), g0[r0.off:r0.off+r0.data])
	twice = append(twice, make([]byte, 32)...)
	padded := append([]byte{}, g0...)
	padded[rz] = 1
	// The same file as GPUCRVM2 and GPUCRVM1 (every byte): still read.
	v1, v2 := []byte("GPUCRVM1"), []byte("GPUCRVM2")
	for _, r := range rs {
		v1 = append(append(v1, rec(r.va, r.n)...), pieceBytes(g0, r)...)
		v2 = append(v2, rec(r.va, r.n)...)
		v2 = append(append(v2, make([]byte, 4096-len(v2)%4096)...), pieceBytes(g0, r)...)
	}
	v1, v2 = append(v1, rec(0, 0)...), append(v2, rec(0, 0)...)
	// Blocks of 3 x 64 KiB leave spare bits in the last byte of the
	// bitmap: one set marks a block past the piece.
	wide := uint64(3 << 16)
	beyond := make([]byte, ((r0.n+wide-1)/wide+7)/8)
	beyond[len(beyond)-1] = 0x80
	all := make([]byte, len(r0.unstored)) // every block left out
	for k := uint64(0); k*r0.block < r0.n; k++ {
		all[k/8] |= 1 << (k % 8)
	}
	for _, tc := range []struct {
		name string
		data []byte
		want string
	}{
		{"bad magic", []byte("GPUCRVM4"), "bad magic"},
		{"empty", nil, "truncated header"},
		{"no end record", []byte("GPUCRVM1"), "no end record"},
		{"outside the mappings", append(append([]byte("GPUCRVM1"), rec(4096, 8)...), make([]byte, 8)...), "not a mapping"},
		{"wraps around", append([]byte("GPUCRVM1"), rec(tg.regions[0].va, 1<<63)...), "not a mapping"},
		{"truncated header", g0[:8+20], "no end record"},
		{"truncated bitmap", g0[:8+32], "truncated in the bitmap"},
		{"truncated padding", g0[:rz+3], fmt.Sprintf("truncated at offset %d", rz)},
		{"padding not zero", padded, fmt.Sprintf("byte %d is not zero", rz)},
		{"truncated range", g0[:rd.off+3], "truncated in range"},
		{"not a piece", append(append([]byte("GPUCRVM1"), rec(tg.regions[0].va, 4096)...), make([]byte, 4096)...), "not one of its pieces"},
		{"a piece missing", append([]byte("GPUCRVM1"), rec(0, 0)...), "missing"},
		{"a piece twice", twice, "came twice"},
		{"block not pages", one(4097, 0, []byte(r0.unstored)), "block size 4097"},
		{"block zero", one(0, 0, nil), "block size 0"},
		{"bitmap beyond the blocks", one(wide, 0, beyond), "the bitmap marks block"},
		{"more cached than left out", one(r0.block, r0.n+1, all), "more than the"},
		{"data short of the bitmap", one(r0.block, 0, make([]byte, len(r0.unstored))), "truncated in range"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range good {
				st.files[k] = v
			}
			st.files[f0] = tc.data
			if _, _, _, err := FastResume(ctx, tg.sockDir, tg.pid, files, st.get, nil); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("resume: %v, want %q", err, tc.want)
			}
			if r := tg.report(t); !r.Parked {
				t.Fatalf("not parked after a bad file: %+v", r)
			}
		})
	}
	for k, v := range good {
		st.files[k] = v
	}
	for _, old := range [][]byte{v1, v2} {
		st.files[f0] = old
		if _, _, _, err := FastResume(ctx, tg.sockDir, tg.pid, files, st.get, nil); err != nil {
			t.Fatalf("resume with one file in %s: %v", old[:8], err)
		}
		tg.mustBeIntact(t)
		st2, s2 := fastSuspended(t, tg, false)
		st.files, files = st2.files, s2.Procs()[0].Files
	}
}

// TestFastCheckIncapable: what the library cannot recreate makes the
// process incapable, and the check says why (want "": still capable). The
// flags and access cases are noticed while the library holds its table
// lock: a target that hangs there (the library locking it twice) never
// gets ready.
func TestFastCheckIncapable(t *testing.T) {
	for _, c := range []struct{ env, want string }{
		{"FP_MANAGED=1", "cuMemAllocManaged"},
		{"FP_CREATE_FLAGS=1", "cuMemCreate with flags 1"},
		{"FP_WIDE_ACCESS=1", "access set for more than 4 locations"},
		{"FP_POOL=1", ""},
	} {
		t.Run(c.env, func(t *testing.T) {
			tg := startTarget(t, c.env)
			_, err := FastCheck(context.Background(), tg.sockDir, []int{tg.pid})
			if c.want == "" {
				if err != nil {
					t.Fatalf("check of a process with %s: %v, want capable", c.env, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("check of a process with %s: %v, want %q", c.env, err, c.want)
			}
		})
	}
	tg := startTarget(t)
	if _, err := FastCheck(context.Background(), tg.sockDir, []int{1 << 22}); !errors.Is(err, preloadctl.ErrNotLoaded) {
		t.Fatalf("check of a process without the library: %v", err)
	}
}

// FuzzCopyIn feeds arbitrary bytes to the library's VRAM file reader, as
// one of a process's files on restore (the others good): it must refuse
// anything that does not cover every piece exactly once, and leave the
// process parked, never crash it.
func FuzzCopyIn(f *testing.F) {
	ctx := context.Background()
	tg := startTarget(f)
	st, s := fastSuspended(f, tg, false)
	files := s.Procs()[0].Files
	g0 := st.files[files[0]]
	f.Add(g0)
	f.Add([]byte("GPUCRVM1"))
	f.Add(append([]byte("GPUCRVM1"), make([]byte, 16)...))
	f.Add(append([]byte("GPUCRVM2"), make([]byte, 16)...))
	f.Add(append([]byte("GPUCRVM3"), make([]byte, 32)...))
	if rs := parseRecords(f, files[0], g0); len(rs) > 0 {
		// The first record alone, its data cut short.
		f.Add(g0[:rs[0].off+rs[0].data/2])
	}
	if len(g0) > 40 {
		f.Add(g0[:40])
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		get := func(ctx context.Context, name string, w io.Writer) error {
			if name == files[0] {
				_, err := w.Write(data)
				return err
			}
			return st.get(ctx, name, w)
		}
		_, _, _, err := FastResume(ctx, tg.sockDir, tg.pid, files, get, nil)
		if err == nil {
			// It covered everything: move the memory out again for the
			// next input.
			if !bytes.Equal(data, st.files[files[0]]) {
				t.Logf("accepted %d bytes that are not the file written", len(data))
			}
			tg.mustBeIntact(t)
			st2 := newStore()
			s, err := FastSuspend(ctx, []int{tg.pid}, st2.put, fastOpts(tg, t))
			if err != nil {
				t.Fatal(err)
			}
			s.Commit()
			st.files = st2.files
			return
		}
		if r := tg.report(t); !r.Parked || !r.Unfilled {
			t.Fatalf("after a refused copy-in (%v): %+v, want parked and unfilled", err, r)
		}
		// Nothing lets the program run on memory that was not refilled.
		p, err := preloadctl.Dial(ctx, tg.sockDir, tg.pid)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		if err := p.Unpark(ctx); err == nil || !strings.Contains(err.Error(), "not refilled") {
			t.Fatalf("unpark after a refused copy-in: %v", err)
		}
	})
}

// gpucr-stream dies between the release and the commit, while it stores
// the VRAM files from the kept copy: its connections end without Detach. Before the driver's lock was announced the library
// refills from the kept copy and unparks by itself; after it, the process
// waits, parked, until FastRecover (gpu resume --pid) after the driver's
// restore. A damaged or missing kept copy leaves it parked, and it says so.
func TestFastPathOrphaned(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		driver bool                         // BeforeDriver was said
		damage func(t *testing.T, k string) // the kept file with most ranges
		detach bool                         // Detach before the end (CRIU's turn)
		state  string                       // what the status file says
		runs   bool                         // the program runs on by itself
	}{
		{name: "before the driver", state: "resumed", runs: true},
		{name: "after the driver", driver: true, state: "waiting"},
		{name: "damaged kept copy", damage: truncate, state: "NOT RESUMED"},
		{name: "kept copy garbage", damage: garble, state: "NOT RESUMED"},
		{name: "kept copy removed", damage: remove, state: "resumed", runs: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tg := startTarget(t)
			used := tg.report(t).DeviceUsed
			st := newStore()
			st.block = make(chan struct{}) // the store is in flight
			o := fastOpts(tg, t)
			s, err := FastSuspend(ctx, []int{tg.pid}, st.put, o)
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				close(st.block)
				_ = s.Wait(ctx) // the test's own goroutines, not the library's
			}()
			keptBytes := map[string][]byte{}
			for _, k := range keptPaths(s, 0) {
				b, err := os.ReadFile(k)
				if err != nil {
					t.Fatal(err)
				}
				keptBytes[k] = b
			}
			if tc.driver {
				if err := s.BeforeDriver(ctx); err != nil {
					t.Fatal(err)
				}
			}
			keep := keptPaths(s, 0)
			if tc.damage != nil {
				big := keep[0]
				for _, k := range keep {
					if fi, err := os.Stat(k); err == nil && fi.Size() > mustSize(t, big) {
						big = k
					}
				}
				tc.damage(t, big)
			}
			// gpucr-stream dies: its connection ends, nothing else.
			s.procs[0].p.Close()
			status := preloadctl.StatusFile(tg.sockDir, tg.pid)
			var said []byte
			for end := time.Now().Add(5 * time.Second); time.Now().Before(end) && len(said) == 0; time.Sleep(5 * time.Millisecond) {
				said, _ = os.ReadFile(status)
			}
			if !strings.HasPrefix(string(said), tc.state+":") {
				t.Fatalf("status file: %q, want %q", said, tc.state)
			}
			if out, _ := os.ReadFile(tg.out); !strings.Contains(string(out), "gpucr-preload["+strconv.Itoa(tg.pid)+"]: "+tc.state+":") {
				t.Fatalf("the process said nothing on stderr: %q", out)
			}
			if !tc.runs {
				if r := tg.check(t, 200*time.Millisecond); r != "" {
					t.Fatalf("the target ran: %q (%s)", r, said)
				}
				// Released, or (a refill that failed) mapped again but not
				// refilled: never running.
				if r := tg.report(t); !r.Parked || !(r.Released || r.Unfilled) || r.Driver != tc.driver || len(r.Kept) != 3 {
					t.Fatalf("report: %+v", r)
				}
				if tc.state == "waiting" && !strings.Contains(string(said), "gpu resume --pid "+strconv.Itoa(tg.pid)) {
					t.Fatalf("the status does not say what to run: %s", said)
				}
				if tc.damage != nil {
					if _, err := FastRecover(ctx, tg.sockDir, o.Records, []int{tg.pid}); err == nil {
						t.Fatal("recover from a damaged kept copy succeeded")
					}
					// Repaired (as it went into the checkpoint), it comes back.
					for _, k := range keep {
						if err := os.WriteFile(k, keptBytes[k], 0o600); err != nil {
							t.Fatal(err)
						}
					}
				}
				done, err := FastRecover(ctx, tg.sockDir, o.Records, []int{tg.pid})
				if err != nil || len(done) != 1 {
					t.Fatalf("recover: %v %v", done, err)
				}
				if b, _ := os.ReadFile(status); !strings.HasPrefix(string(b), "resumed: recover") {
					t.Fatalf("status after recover: %q", b)
				}
			}
			tg.mustBeIntact(t)
			if r := tg.report(t); r.Parked || r.Released || r.DeviceUsed != used || len(r.Kept) != 0 {
				t.Fatalf("after: %+v, want running with %d bytes of device memory", r, used)
			}
			if ents, _ := os.ReadDir(o.KeepDir); len(ents) != 0 {
				t.Fatalf("kept copy left behind: %d files", len(ents))
			}
			// Nothing more to do for the undo of the dead gpucr-stream's
			// state (a second recover finds the process running).
			if done, err := FastRecover(ctx, tg.sockDir, o.Records, []int{tg.pid}); err != nil || len(done) != 0 {
				t.Fatalf("second recover: %v %v", done, err)
			}
		})
	}
}

func mustSize(t *testing.T, path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}

func truncate(t *testing.T, k string) {
	if err := os.Truncate(k, mustSize(t, k)-100); err != nil {
		t.Fatal(err)
	}
}

// garble overwrites the first record's header: its range is not a piece.
func garble(t *testing.T, k string) {
	f, err := os.OpenFile(k, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt([]byte{1, 2, 3, 4, 5, 6, 7, 8}, 8); err != nil {
		t.Fatal(err)
	}
}

// remove unlinks the file: the library holds it open, so it still refills.
func remove(t *testing.T, k string) {
	if err := os.Remove(k); err != nil {
		t.Fatal(err)
	}
}

// After Detach the library holds only the paths: a kept copy removed then
// cannot refill the process, which stays parked; recover says so.
func TestFastRecoverMissing(t *testing.T) {
	ctx := context.Background()
	tg := startTarget(t)
	o := fastOpts(tg, t)
	s, err := FastSuspend(ctx, []int{tg.pid}, newStore().put, o)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if r := tg.report(t); !r.Detached || len(r.Kept) != 3 {
		t.Fatalf("report: %+v", r)
	}
	s.Commit() // removes the kept copy
	if _, err := FastRecover(ctx, tg.sockDir, o.Records, []int{tg.pid}); err == nil || !strings.Contains(err.Error(), "kept no copy") || !strings.Contains(err.Error(), "--from") {
		t.Fatalf("recover without the kept copy: %v", err)
	}
	if r := tg.report(t); !r.Parked || !r.Released {
		t.Fatalf("report: %+v", r)
	}
	if r := tg.check(t, 200*time.Millisecond); r != "" {
		t.Fatalf("the target ran: %q", r)
	}
}

// TestFastPathTwoProcesses: two processes (a tree's ranks) are copied out
// at once, both released, stored, and each comes back intact.
func TestFastPathTwoProcesses(t *testing.T) {
	a := startTarget(t)
	b := startTarget(t, "GPUCR_PRELOAD_DIR="+a.sockDir) // one socket dir
	ctx := context.Background()
	st := newStore()
	o := fastOpts(a, t)
	s, err := FastSuspend(ctx, []int{a.pid, b.pid}, st.put, o)
	if err != nil {
		t.Fatal(err)
	}
	for _, fp := range s.procs {
		if r, err := fp.p.Report(ctx); err != nil || !r.Released || r.DeviceUsed != 0 {
			t.Fatalf("process %d after the release: %+v %v", fp.PID, r, err)
		}
	}
	if err := s.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	s.Commit()
	procs := s.Procs()
	if len(procs) != 2 || len(st.files) != 6 {
		t.Fatalf("procs %+v, %d files stored, want 2 processes and 6 files", procs, len(st.files))
	}
	for i, tg := range []*target{a, b} {
		if _, _, _, err := FastResume(ctx, a.sockDir, procs[i].PID, procs[i].Files, st.get, nil); err != nil {
			t.Fatalf("resume %d: %v", procs[i].PID, err)
		}
		tg.mustBeIntact(t)
	}
}

// TestFileName: every name copy out gives a file is one FilePID reads
// back, for every file count --vram-files allows.
func TestFileName(t *testing.T) {
	for _, pid := range []int{1, 42, 4194304} {
		for k := 0; k < 64; k++ {
			if got, ok := FilePID(fileName(pid, k)); !ok || got != pid {
				t.Fatalf("FilePID(%q) = %d %v, want %d", fileName(pid, k), got, ok, pid)
			}
		}
	}
}

// TestCollectiveBarrier: the library's collective barrier (preload/gate.c)
// on a target whose every launch is a collective (its kernel named as
// NCCL's, mangled and plain) or none is. A hold stops the launches where
// they are; until N lets exactly N through and holds again; a held launch
// does not keep park from closing the gate; unpark lets it go. A target
// without collectives is never held.
func TestCollectiveBarrier(t *testing.T) {
	ctx := context.Background()
	for _, name := range []string{"_Z39ncclDevKernel_AllReduce_Sum_f32_RING_LLv", "ncclKernel_AllGather"} {
		t.Run(name, func(t *testing.T) {
			tg := startTarget(t, "GPUCR_FAKE_KERNEL_NAME="+name)
			p, err := preloadctl.Dial(ctx, tg.sockDir, tg.pid)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			n0, err := p.CollectivesHold(ctx)
			if err != nil {
				t.Fatal(err)
			}
			time.Sleep(50 * time.Millisecond)
			if n, err := p.CollectivesHold(ctx); err != nil || n != n0 {
				t.Fatalf("held at %d, then %d (%v): launches went on", n0, n, err)
			}
			if n, err := p.CollectivesUntil(ctx, n0+5, 5*time.Second); err != nil || n != n0+5 {
				t.Fatalf("until %d: %d, %v", n0+5, n, err)
			}
			time.Sleep(50 * time.Millisecond)
			if n, err := p.CollectivesHold(ctx); err != nil || n != n0+5 {
				t.Fatalf("held again at %d: %d, %v", n0+5, n, err)
			}
			if err := p.Park(ctx, 2*time.Second); err != nil {
				t.Fatalf("park with a launch held at the barrier: %v", err)
			}
			if err := p.Unpark(ctx); err != nil {
				t.Fatal(err)
			}
			time.Sleep(50 * time.Millisecond)
			if n, err := p.CollectivesHold(ctx); err != nil || n <= n0+5 {
				t.Fatalf("after unpark: %d collectives launched, %v: still held at %d", n, err, n0+5)
			}
			if _, err := p.CollectivesUntil(ctx, 1<<40, 100*time.Millisecond); err == nil || !strings.Contains(err.Error(), "within 100 ms") {
				t.Fatalf("until a count never reached: %v", err)
			}
			p.Close()
			// The connection that held is gone, not parked: released.
			if n1, n2 := tg.collectives(t), tg.collectives(t); n2 <= n1 {
				t.Fatalf("after the holder left: %d, then %d: still held", n1, n2)
			}
			tg.mustBeIntact(t)
		})
	}
	t.Run("none", func(t *testing.T) {
		tg := startTarget(t)
		if n := tg.collectives(t); n != 0 {
			t.Fatalf("a target without collectives launched %d", n)
		}
		tg.mustBeIntact(t)
	})
}

// collectives holds the target's collectives for a moment and tells how
// many it launched (the hold ends with the connection).
func (tg *target) collectives(t *testing.T) int64 {
	t.Helper()
	p, err := preloadctl.Dial(context.Background(), tg.sockDir, tg.pid)
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

// TestFastPathSharedMemory: a process that maps memory it imported through
// a shareable handle (here its own export, as an NCCL rank maps a peer's
// buffer) takes the fast path: the import is released with the rest and
// never copied; after the refill the process stays parked until Reimport
// has the exporter export its new handle and the importer map it where
// the old one was; then both addresses hold the refilled bytes. The undo
// (a failed checkpoint) does the same.
func TestFastPathSharedMemory(t *testing.T) {
	ctx := context.Background()
	tg := startTarget(t, "FP_SELF_SHARE=1")
	reps, err := FastCheck(ctx, tg.sockDir, []int{tg.pid})
	if err != nil {
		t.Fatalf("a process that imports its own export: %v, want capable", err)
	}
	var own int64
	for _, r := range tg.regions {
		if r.name != "imported" {
			own += int64(r.size)
		}
	}
	if reps[0].Bytes < own || reps[0].Bytes >= own+2<<20+3<<20 {
		t.Fatalf("report: %d bytes, want the process's own (%d, rounded up), not the import", reps[0].Bytes, own)
	}
	tg.mustBeIntact(t)

	st, s := fastSuspended(t, tg, false)
	files := s.Procs()[0].Files
	if _, _, _, err := FastResume(ctx, tg.sockDir, tg.pid, files, st.get, nil); err != nil {
		t.Fatal(err)
	}
	if r := tg.report(t); !r.Parked {
		t.Fatalf("after the refill, the import not mapped again: %+v, want parked", r)
	}
	// What the process says it imported from is believed only for a
	// process of the tree: pid 1 is not, and the process stays parked.
	p, err := preloadctl.Dial(ctx, tg.sockDir, tg.pid)
	if err != nil {
		t.Fatal(err)
	}
	sh, err := p.Shared(ctx)
	if err != nil || len(sh.Imports) != 1 || sh.Imports[0].SrcPID != tg.pid {
		t.Fatalf("shared after the refill: %+v %v, want one import, from the process itself", sh, err)
	}
	im := sh.Imports[0]
	if err := p.Source(ctx, im.H, 1, im.SrcH); err != nil {
		t.Fatal(err)
	}
	p.Close()
	if err := Reimport(ctx, tg.sockDir, []int{tg.pid}); !errors.Is(err, ErrSharedOutside) {
		t.Fatalf("reimport from a process outside the tree: %v, want ErrSharedOutside", err)
	}
	if r := tg.report(t); !r.Parked {
		t.Fatalf("after a refused reimport: %+v, want parked", r)
	}
	p, err = preloadctl.Dial(ctx, tg.sockDir, tg.pid)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Source(ctx, im.H, im.SrcPID, im.SrcH); err != nil {
		t.Fatal(err)
	}
	p.Close()
	if err := Reimport(ctx, tg.sockDir, []int{tg.pid}); err != nil {
		t.Fatal(err)
	}
	if r := tg.report(t); r.Parked {
		t.Fatalf("after Reimport: %+v, want running", r)
	}
	tg.mustBeIntact(t)

	// The undo of a checkpoint that failed after the release.
	st2 := newStore()
	s2, err := FastSuspend(ctx, []int{tg.pid}, st2.put, fastOpts(tg, t))
	if err != nil {
		t.Fatal(err)
	}
	if err := s2.Undo(ctx); err != nil {
		t.Fatalf("undo: %v", err)
	}
	if r := tg.report(t); r.Parked {
		t.Fatalf("after the undo: %+v, want running", r)
	}
	tg.mustBeIntact(t)
}
