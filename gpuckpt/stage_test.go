package gpuckpt

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/testwait"
)

// fileSource serves files from memory; a file named in hold waits for its
// channel to close before it is copied, one in fail fails.
type fileSource struct {
	source.Source
	data   map[string][]byte
	hold   map[string]chan struct{}
	fail   map[string]error
	mu     sync.Mutex
	copies map[string]int
}

func (s *fileSource) Files(context.Context) ([]manifest.File, error) {
	var fs []manifest.File
	for n, b := range s.data {
		fs = append(fs, manifest.File{Name: n, Size: int64(len(b))})
	}
	return fs, nil
}

func (s *fileSource) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	s.mu.Lock()
	s.copies[name]++
	s.mu.Unlock()
	if c, ok := s.hold[name]; ok {
		select {
		case <-c:
		case <-ctx.Done():
			return 0, context.Cause(ctx)
		}
	}
	if err := s.fail[name]; err != nil {
		return 0, err
	}
	b, ok := s.data[name]
	if !ok {
		return 0, errdefs.ErrNotFound
	}
	n, err := w.Write(b)
	return int64(n), err
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestStage: the VRAM files are staged within the memory limit; Take hands
// over each staged file whole and read-only, and nil for one that is not
// staged (over the limit, or asked for before its staging began: it is
// never staged then); a failed staging is Take's error; Close frees every
// staged file, taken or not (and, as root, the stage's tmpfs).
func TestStage(t *testing.T) {
	t.Run("tmpfs", func(t *testing.T) { testStage(t, true) })
	// Where no tmpfs can be mounted (not root, say): memfds.
	t.Run("memfd", func(t *testing.T) {
		f := filepath.Join(t.TempDir(), "file")
		if err := os.WriteFile(f, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		old := stageRoot
		stageRoot = filepath.Join(f, "root")
		defer func() { stageRoot = old }()
		testStage(t, false)
	})
}

func testStage(t *testing.T, tmpfs bool) {
	const size = 1 << 20
	file := func(pid, k int) string { return fmt.Sprintf("vram-%d-%02d.bin", pid, k) }
	data := map[string][]byte{}
	var procs []manifest.CUDAProcess
	for _, pid := range []int{10, 20} {
		p := manifest.CUDAProcess{PID: pid, Path: manifest.CUDAPathPreload}
		for k := range 3 {
			b := bytes.Repeat([]byte{byte(pid + k)}, size)
			data[file(pid, k)] = b
			p.Files = append(p.Files, file(pid, k))
			p.Bytes += size
		}
		procs = append(procs, p)
	}
	data["pages-1.img"] = make([]byte, 100)
	driverOnly := manifest.CUDAProcess{PID: 30, Path: manifest.CUDAPathDriver}
	failed := errors.New("chunk 0: checksum mismatch")
	tests := []struct {
		name   string
		memory StageMemory
		// held (staging never ends) and failing files; taken first: files
		// Take asks for before any staging ends.
		hold, fail []string
		// want: staged (handed over), streamed (nil), failed; the phase
		// names how many were staged.
		staged, streamed, failing []string
		phase                     string
	}{
		{name: "all fit", memory: 6 * size,
			staged: []string{file(10, 0), file(10, 1), file(10, 2), file(20, 0), file(20, 1), file(20, 2)}, phase: "(6 of 6 files, 0.01 GiB)"},
		// Interleaved over the processes: file 0 of each, then file 1.
		{name: "four fit", memory: 4*size + size/2,
			staged:   []string{file(10, 0), file(20, 0), file(10, 1), file(20, 1)},
			streamed: []string{file(10, 2), file(20, 2)}, phase: "(4 of 6 files"},
		{name: "none", memory: -1, streamed: []string{file(10, 0), file(20, 2)}},
		{name: "a failure", memory: 6 * size, fail: []string{file(20, 1)},
			staged:  []string{file(10, 0), file(20, 0), file(10, 1), file(10, 2), file(20, 2)},
			failing: []string{file(20, 1)}, phase: "(5 of 6 files"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			src := &fileSource{data: data, hold: map[string]chan struct{}{}, fail: map[string]error{}, copies: map[string]int{}}
			for _, n := range tc.fail {
				src.fail[n] = failed
			}
			fds := openFDs(t)
			s, err := StartStage(ctx, src, append(procs, driverOnly), tc.memory)
			if err != nil {
				t.Fatal(err)
			}
			if (s == nil) != (tc.memory < 0) {
				t.Fatalf("StartStage = %v with memory %d", s, tc.memory)
			}
			if s != nil {
				s.wg.Wait() // CRIU's restore took long enough to stage all
				if want := tmpfs && os.Geteuid() == 0; (s.dir != nil) != want {
					t.Fatalf("staged on a tmpfs of the stage's own: %v, want %v", s.dir != nil, want)
				}
			}
			for _, n := range tc.staged {
				f, err := s.Take(ctx, n)
				if err != nil || f == nil {
					t.Fatalf("Take(%s) = %v, %v; want it staged", n, f, err)
				}
				got, err := io.ReadAll(f)
				if err != nil || !bytes.Equal(got, data[n]) {
					t.Fatalf("%s: staged %d bytes (%v), want its %d", n, len(got), err, len(data[n]))
				}
				if _, err := f.Write([]byte{0}); err == nil {
					t.Fatalf("%s: the staged file is writable", n)
				}
			}
			for _, n := range tc.streamed {
				if f, err := s.Take(ctx, n); f != nil || err != nil {
					t.Fatalf("Take(%s) = %v, %v; want nil (streamed)", n, f, err)
				}
			}
			for _, n := range tc.failing {
				if f, err := s.Take(ctx, n); f != nil || !errors.Is(err, failed) {
					t.Fatalf("Take(%s) = %v, %v; want %v", n, f, err, failed)
				}
			}
			s.Close()
			if got := openFDs(t); got != fds {
				t.Fatalf("%d descriptors open after Close, %d before", got, fds)
			}
			if ps := s.Phases(); tc.phase != "" && (len(ps) != 1 || !strings.Contains(ps[0].Name, tc.phase)) {
				t.Fatalf("phases %+v, want one naming %q", ps, tc.phase)
			}
		})
	}
}

// TestStageTakeBeforeStaged: a file the copy in asks for before its
// staging began is streamed (nil) and never staged; one being staged is
// waited for; Close stops a staging that hangs.
func TestStageTakeBeforeStaged(t *testing.T) {
	const size = 1 << 12
	data := map[string][]byte{}
	p := manifest.CUDAProcess{PID: 10, Path: manifest.CUDAPathPreload}
	for k := range 64 { // more than the staging's workers
		n := fmt.Sprintf("vram-10-%02d.bin", k)
		data[n] = bytes.Repeat([]byte{byte(k)}, size)
		p.Files = append(p.Files, n)
	}
	gate := make(chan struct{})
	src := &fileSource{data: data, hold: map[string]chan struct{}{}, fail: map[string]error{}, copies: map[string]int{}}
	for _, n := range p.Files {
		src.hold[n] = gate // every staging waits
	}
	ctx := context.Background()
	s, err := StartStage(ctx, src, []manifest.CUDAProcess{p}, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	// The workers took the first files and wait; the last is queued.
	for end := time.Now().Add(testwait.Scale(5 * time.Second)); ; time.Sleep(time.Millisecond) {
		src.mu.Lock()
		started := len(src.copies)
		src.mu.Unlock()
		if started > 0 && started < len(p.Files) {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("%d stagings started, want some but not all", started)
		}
	}
	last := p.Files[len(p.Files)-1]
	if f, err := s.Take(ctx, last); f != nil || err != nil {
		t.Fatalf("Take of a queued file = %v, %v; want nil", f, err)
	}
	got := make(chan error, 1)
	go func() {
		f, err := s.Take(ctx, p.Files[0])
		if f == nil && err == nil {
			err = errors.New("not staged")
		}
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("Take of a file being staged returned before it was: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(gate)
	if err := <-got; err != nil {
		t.Fatalf("Take of the file being staged: %v", err)
	}
	s.Close()
	if src.copies[last] != 0 {
		t.Fatalf("%s staged after it was left to the copy in", last)
	}

	// A staging that never ends is stopped by Close.
	src = &fileSource{data: data, hold: map[string]chan struct{}{p.Files[0]: make(chan struct{})}, fail: map[string]error{}, copies: map[string]int{}}
	if s, err = StartStage(ctx, src, []manifest.CUDAProcess{p}, 1<<30); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { s.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(testwait.Scale(5 * time.Second)):
		t.Fatal("Close did not stop a staging that hangs")
	}
}
