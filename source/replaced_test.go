package source

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/pipeline"
)

// replacements is a stream that sends one 1 MiB file n times, version i
// all bytes version(i), never zero (lz4: the stream itself stays small, each copy decodes
// into a page buffer of its own), and where the first copy ends in it.
func replacements(t testing.TB, n int) (b []byte, first int) {
	h := newHostile(t)
	for i := range n {
		raw := bytes.Repeat([]byte{version(i)}, minSpliceChunk)
		h.file(uint32(i), "pages-1.img")
		sum := h.data(uint32(i), 0, "lz4", raw)
		h.fileEnd(uint32(i), uint64(len(raw)), [][32]byte{sum})
		if i == 0 {
			first = int(h.w.Pos())
		}
	}
	return h.bytes(), first
}

func version(i int) byte { return byte(1 + i%255) }

// procKiB reads a "Name: N kB" line of /proc/self/status, in bytes.
func procKiB(t testing.TB, name string) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, name+":"); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n << 10
		}
	}
	t.Fatalf("no %s in /proc/self/status", name)
	return 0
}

// A stream that re-sends one file keeps one copy of it: each replaced
// copy's page buffers are freed at once, by the source's own count and by
// the process's peak resident memory (1,500 copies of 1 MiB under a 64 MiB
// limit kept 3 GB until Close).
func TestStreamReplacedFileFreed(t *testing.T) {
	const limit, copies = 16 << 20, 300
	so := StreamSourceOptions{Options: pipeline.Options{Workers: 2, MemoryLimit: limit}}
	b, _ := replacements(t, copies)
	debug.FreeOSMemory()
	// The peak resident set (VmHWM) restarts at the current one.
	if err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0); err != nil {
		t.Fatal(err)
	}
	before := procKiB(t, "VmRSS")
	s := NewStreamSource(context.Background(), []io.Reader{bytes.NewReader(b)}, []string{"stdin"}, so)
	defer s.Close()
	if err := s.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	peak := procKiB(t, "VmHWM") - before
	s.mu.Lock()
	memUsed, retired := s.memUsed, len(s.retired)
	s.mu.Unlock()
	t.Logf("%d copies of 1 MiB: %d bytes counted, resident set grew by at most %d", copies, memUsed, peak)
	if want := int64(roundHuge(minSpliceChunk)); memUsed != want || retired != 0 {
		t.Errorf("counts %d bytes of chunks and %d retired files, want %d (one copy) and none", memUsed, retired, want)
	}
	if peak > limit {
		t.Errorf("resident set grew by %d bytes for a memory limit of %d", peak, limit)
	}
	got, err := copyThroughPipe(context.Background(), s, "pages-1.img", false, -1)
	if err != nil || !bytes.Equal(got, bytes.Repeat([]byte{version(copies - 1)}, minSpliceChunk)) {
		t.Fatalf("serves the last copy: %v (%d bytes)", err, len(got))
	}
}

// blockedWriter takes the first Write's bytes only once released, so a
// Copy is in progress for as long as the test wants.
type blockedWriter struct {
	started, release chan struct{}
	buf              bytes.Buffer
}

func (w *blockedWriter) Write(p []byte) (int, error) {
	if w.started != nil {
		close(w.started)
		w.started = nil
		<-w.release
	}
	return w.buf.Write(p)
}

// A copy replaced while a Copy reads it stays mapped and counted until
// that Copy ends, then is freed.
func TestStreamReplacedWhileCopied(t *testing.T) {
	const copies = 20
	ctx := context.Background()
	b, first := replacements(t, copies)
	pr, pw := io.Pipe()
	so := StreamSourceOptions{Options: pipeline.Options{Workers: 2, MemoryLimit: 256 << 20}, ServeEarly: true}
	s := NewStreamSource(ctx, []io.Reader{pr}, []string{"stdin"}, so)
	defer s.Close()
	// The first copy, then the others once its Copy has begun.
	sent := make(chan error, 1)
	go func() {
		_, err := pw.Write(b[:first])
		sent <- err
	}()
	w := &blockedWriter{started: make(chan struct{}), release: make(chan struct{})}
	started := w.started
	type result struct {
		n   int64
		err error
	}
	done := make(chan result, 1)
	go func() {
		n, err := s.Copy(ctx, "pages-1.img", w)
		done <- result{n, err}
	}()
	<-started
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	go func() {
		_, err := pw.Write(b[first:])
		pw.CloseWithError(err)
		sent <- err
	}()
	if err := s.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	one := int64(roundHuge(minSpliceChunk))
	s.mu.Lock()
	used, retired := s.memUsed, len(s.retired)
	s.mu.Unlock()
	if used != 2*one || retired != 1 {
		t.Fatalf("while copied: %d bytes counted, %d retired files; want %d (the copy read and the last) and 1", used, retired, 2*one)
	}
	close(w.release)
	r := <-done
	if r.err != nil || r.n != minSpliceChunk {
		t.Fatalf("Copy: %d bytes, %v", r.n, r.err)
	}
	if !bytes.Equal(w.buf.Bytes(), bytes.Repeat([]byte{version(0)}, minSpliceChunk)) {
		t.Fatal("Copy wrote other bytes than the first copy's")
	}
	s.mu.Lock()
	used, retired = s.memUsed, len(s.retired)
	s.mu.Unlock()
	if used != one || retired != 0 {
		t.Fatalf("after the Copy: %d bytes counted, %d retired files; want %d and none", used, retired, one)
	}
}

// watchDir counts the files created in dir and renamed into it while
// read runs (inotify's IN_CREATE and IN_MOVED_TO events, which a queue of
// 16384 holds for what this test does; the kernel merges an event into
// the one before it when they are the same, the creates between keep
// renames apart).
func watchDir(t *testing.T, dir string, read func()) (created, renamed int) {
	t.Helper()
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_MOVED_TO|unix.IN_CREATE); err != nil {
		t.Fatal(err)
	}
	read()
	buf := make([]byte, 64<<10)
	for {
		k, err := unix.Read(fd, buf)
		if err == unix.EAGAIN {
			return created, renamed
		}
		if err != nil {
			t.Fatal(err)
		}
		for off := 0; off < k; {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			switch {
			case ev.Mask&unix.IN_Q_OVERFLOW != 0:
				t.Fatal("inotify queue overflowed")
			case ev.Mask&unix.IN_MOVED_TO != 0:
				renamed++
			case ev.Mask&unix.IN_CREATE != 0:
				created++
			}
			off += unix.SizeofInotifyEvent + int(ev.Len)
		}
	}
}

// An extract of a stream that replaces one file many times renames it
// into place once, creates a few temporary files, not one a copy, and
// leaves none (100,000 replacements took 100,000 renames, 6 minutes on
// ext4). The copies differ in size and in where their zero chunks are
// (holes in the file): a temporary file used again holds nothing of an
// earlier copy.
func TestStreamExtractReplacementsRenamedOnce(t *testing.T) {
	const copies = 2002 // the last one starts with a zero chunk
	version := func(i int) []byte {
		b := []byte(fmt.Sprintf("inventory, version %d", i))
		if i%2 == 0 {
			return append(b, bytes.Repeat([]byte{'x'}, 4096-len(b))...)
		}
		return b
	}
	h := newHostile(t)
	for i := range copies {
		raw := version(i)
		h.file(uint32(i), "inventory.img")
		if i%3 == 0 { // a zero chunk first, where other copies have data
			h.fileEnd(uint32(i), uint64(4096+len(raw)), [][32]byte{h.data(uint32(i), 0, "none", make([]byte, 4096)), h.data(uint32(i), 4096, "none", raw)})
		} else {
			h.fileEnd(uint32(i), uint64(len(raw)), [][32]byte{h.data(uint32(i), 0, "none", raw)})
		}
	}
	h.file(copies, "core-1.img")
	h.fileEnd(copies, 4, [][32]byte{h.data(copies, 0, "none", []byte("core"))})
	b := h.bytes()
	dir := t.TempDir()
	created, renamed := watchDir(t, dir, func() {
		s := NewStreamSource(context.Background(), []io.Reader{bytes.NewReader(b)}, []string{"stdin"}, StreamSourceOptions{ExtractDir: dir})
		defer s.Close()
		if err := s.Wait(context.Background()); err != nil {
			t.Fatal(err)
		}
		if ents, _ := os.ReadDir(dir); len(ents) != 2 {
			t.Fatalf("once the stream is read, %d entries in the directory, want 2", len(ents))
		}
	})
	t.Logf("%d copies of one file and one other: %d files created, %d renamed into the directory", copies, created, renamed)
	if renamed != 2 {
		t.Errorf("%d renames into the directory seen, want 2", renamed)
	}
	// At most a file for each copy that may arrive at once, and one more.
	workers := (pipeline.Options{}).WithDefaults().Workers
	if most := 2*workers + 1 + 1; created > most {
		t.Errorf("%d temporary files created for %d copies of one file, want at most %d", created, copies, most)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 2 {
		t.Fatalf("%d entries left in the directory, want 2", len(ents))
	}
	want := version(copies - 1)
	if (copies-1)%3 == 0 {
		want = append(make([]byte, 4096), want...)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "inventory.img")); !bytes.Equal(got, want) {
		t.Fatalf("inventory.img holds %q, want the last copy", got)
	}
}
