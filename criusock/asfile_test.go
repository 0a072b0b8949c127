package criusock

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/fdgraft"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/testwait"
)

// A client that asks for files as CRIU's stream mode does (a request, a
// blocking read of the reply, a pipe whose write end goes over the
// socket) and reports what it got to read from. It is this test binary
// again, started twice over so that it is not the serving process's child.
const (
	clientEnv      = "GPUCR_CAPTURE_CLIENT"
	clientNamesEnv = "GPUCR_CAPTURE_CLIENT_NAMES"
	clientSockEnv  = "GPUCR_CAPTURE_CLIENT_SOCKET"
	// clientRepeatEnv asks for the names that many times over and reports
	// what was read, not the bytes (benchmarks).
	clientRepeatEnv = "GPUCR_CAPTURE_CLIENT_REPEAT"
)

func TestMain(m *testing.M) {
	switch os.Getenv(clientEnv) {
	case "":
		os.Exit(m.Run())
	case "start":
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), clientEnv+"=run")
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Start(); err != nil {
			panic(err)
		}
		os.Exit(0)
	default:
		repeat, _ := strconv.Atoi(os.Getenv(clientRepeatEnv))
		var names []string
		for range max(1, repeat) {
			names = append(names, strings.Split(os.Getenv(clientNamesEnv), ",")...)
		}
		start := time.Now()
		files, err := askLikeCRIU(os.Getenv(clientSockEnv), names)
		r := clientReport{Files: files, Nanos: time.Since(start).Nanoseconds()}
		if repeat > 0 {
			for i := range r.Files {
				r.Files[i].Data = nil
			}
		}
		if err != nil {
			r.Error = err.Error()
		}
		json.NewEncoder(os.Stdout).Encode(r)
		os.Exit(0)
	}
}

type clientReport struct {
	Files []clientFile
	Nanos int64 // the time it took, connection to last byte
	Error string
}

// clientFile is what the client read one request's file from.
type clientFile struct {
	Name    string
	Exists  bool
	Regular bool
	Size    int64 // fstat's
	Seals   int   // F_GET_SEALS; -1 where it has none (a pipe)
	Read    int
	Data    []byte
}

func askLikeCRIU(path string, names []string) ([]clientFile, error) {
	// One thread asks and makes the pipe, as CRIU's task does: the task
	// found waiting is the one traced.
	runtime.LockOSThread()
	s, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		return nil, err
	}
	if err := syscall.Connect(s, &syscall.SockaddrUnix{Name: path}); err != nil {
		return nil, err
	}
	sock := os.NewFile(uintptr(s), "socket") // blocking: reads block in read(2), as CRIU's
	defer sock.Close()
	var out []clientFile
	for _, name := range names {
		req, err := EncodeRequest(name)
		if err != nil {
			return out, err
		}
		if _, err := sock.Write(req); err != nil {
			return out, err
		}
		ok, err := ReadReply(sock)
		if err != nil || !ok {
			out = append(out, clientFile{Name: name})
			if err != nil {
				return out, err
			}
			continue
		}
		var p [2]int
		if err := syscall.Pipe(p[:]); err != nil {
			return out, err
		}
		err = syscall.Sendmsg(s, []byte{0}, syscall.UnixRights(p[1]), nil, 0)
		syscall.Close(p[1])
		if err != nil {
			return out, err
		}
		f := clientFile{Name: name, Exists: true}
		var st syscall.Stat_t
		if err := syscall.Fstat(p[0], &st); err != nil {
			return out, err
		}
		f.Regular, f.Size = st.Mode&syscall.S_IFMT == syscall.S_IFREG, st.Size
		if f.Seals, err = unix.FcntlInt(uintptr(p[0]), unix.F_GET_SEALS, 0); err != nil {
			f.Seals = -1
		}
		rd := os.NewFile(uintptr(p[0]), name)
		f.Data, err = io.ReadAll(rd)
		f.Read = len(f.Data)
		rd.Close()
		if err != nil {
			return out, err
		}
		out = append(out, f)
	}
	return out, nil
}

// runClient asks for names from a serve of src, and returns the client's
// report and the serve's result.
func runClient(t testing.TB, ctx context.Context, src source.Source, names ...string) (clientReport, ServeResult, error) {
	t.Helper()
	r, res, _, err := runClientWith(t, ctx, src, 0, ServeOptions{}, names...)
	return r, res, err
}

// runClientWith is runClient with the names asked for repeat times over
// (0: once, with the bytes in the report), served with o (its hooks
// aside); it returns the serve's log lines too.
func runClientWith(t testing.TB, ctx context.Context, src source.Source, repeat int, o ServeOptions, names ...string) (clientReport, ServeResult, []string, error) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("handing CRIU a file traces it: needs root")
		}
		t.Skip("handing CRIU a file traces it: needs root")
	}
	dir := shortDir(t)
	listening := make(chan struct{})
	var res ServeResult
	var serveErr error
	served := make(chan struct{})
	var mu sync.Mutex
	var logs []string
	o.Hooks = Hooks{Listening: func() { close(listening) }, Log: func(s string) {
		mu.Lock()
		logs = append(logs, s)
		mu.Unlock()
	}}
	go func() {
		defer close(served)
		res, serveErr = ServeWith(ctx, dir, src, o)
	}()
	<-listening
	out, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), clientEnv+"=start", clientNamesEnv+"="+strings.Join(names, ","),
		clientSockEnv+"="+filepath.Join(dir, ServeSocket), clientRepeatEnv+"="+strconv.Itoa(repeat))
	cmd.Stdout, cmd.Stderr = w, os.Stderr
	err = cmd.Run()
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	var r clientReport
	if err := json.NewDecoder(out).Decode(&r); err != nil {
		t.Fatalf("client report: %v", err)
	}
	<-served
	return r, res, logs, serveErr
}

// hugeFixture is a checkpoint of one task whose first mapping in address
// order is huge pages: 4 of its pages there, then 4 in an ordinary one.
func hugeFixture(t *testing.T, ctx context.Context) (src source.Source, files map[string][]byte) {
	t.Helper()
	const p = pageSize
	pages := amdPages(8*p, 3)[8:]
	files = map[string][]byte{
		"inventory.img":  []byte("inventory"),
		"nftables-3.img": []byte("table inet t { chain c { type filter hook input priority 0; tcp dport 4242 drop; } }\n"),
		"mm-5.img": mmImg(t, vma{0x200000, 0x400000, anon, mapHugeTLB | 0x22},
			vma{0x1000000, 0x1010000, anon, 0x22}),
		"pagemap-5.img": pagemapImg(9, true, pagemapEntry{0x200000, 4, pePresent}, pagemapEntry{0x1000000, 4, pePresent}),
		"pages-9.img":   pages,
	}
	s := streamOf(t, ctx, files)
	return s, files
}

const allSeals = unix.F_SEAL_SEAL | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_WRITE

// TestServeAsFile: the files CRIU reads as files reach it as sealed
// memfds: nftables-N.img whole, a pages image's second open with only the
// pages of its huge-page mapping (the rest holes), while the first open,
// a pipe, left those pages out; everything else stays a pipe.
func TestServeAsFile(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	src, files := hugeFixture(t, ctx)
	r, res, err := runClient(t, ctx, src, "inventory.img", "nftables-3.img", "missing.img", "pagemap-5.img", "pages-9.img", "pages-9.img")
	if err != nil || r.Error != "" {
		t.Fatalf("serve: %v; client: %s", err, r.Error)
	}
	const half = 4 * pageSize
	pages := files["pages-9.img"]
	second := append(bytes.Clone(pages[:half]), make([]byte, half)...)
	pipe := func(b []byte) clientFile { return clientFile{Exists: true, Seals: -1, Data: b} }
	memfd := func(b []byte) clientFile {
		return clientFile{Exists: true, Regular: true, Size: int64(len(b)), Seals: allSeals, Data: b}
	}
	want := []clientFile{
		pipe(files["inventory.img"]),
		memfd(files["nftables-3.img"]),
		{},
		pipe(files["pagemap-5.img"]),
		pipe(pages[half:]),
		memfd(second),
	}
	if len(r.Files) != len(want) {
		t.Fatalf("client got %d files, want %d", len(r.Files), len(want))
	}
	for i, w := range want {
		g := r.Files[i]
		w.Name = g.Name
		if g.Exists != w.Exists || g.Regular != w.Regular || g.Size != w.Size || g.Seals != w.Seals || !bytes.Equal(g.Data, w.Data) {
			t.Errorf("%s (request %d): got regular %v size %d seals %#x, %d bytes; want regular %v size %d seals %#x, %d bytes (equal %v)",
				g.Name, i, g.Regular, g.Size, g.Seals, len(g.Data), w.Regular, w.Size, w.Seals, len(w.Data), bytes.Equal(g.Data, w.Data))
		}
	}
	if res.Served != 5 || res.ClosedEarly != 0 {
		t.Errorf("serve result %+v, want 5 served", res)
	}
}

// TestServeAsFileSpills: beyond the memfds' share of the memory limit, an
// image CRIU reads as a file is an unlinked file in the spill directory:
// the same bytes and size, no memory.
func TestServeAsFileSpills(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	src, files := hugeFixture(t, ctx)
	spill := t.TempDir()
	r, res, logs, err := runClientWith(t, ctx, src, 0, ServeOptions{MemoryLimit: 64, SpillDir: spill}, "nftables-3.img")
	if err != nil || r.Error != "" {
		t.Fatalf("serve: %v; client: %s", err, r.Error)
	}
	want := files["nftables-3.img"]
	if len(r.Files) != 1 || !r.Files[0].Regular || r.Files[0].Size != int64(len(want)) || !bytes.Equal(r.Files[0].Data, want) || res.Served != 1 {
		t.Fatalf("client got %+v, serve %+v; want a regular file of %d bytes", r.Files, res, len(want))
	}
	if len(logs) != 1 || !strings.Contains(logs[0], "an unlinked file in "+spill) {
		t.Errorf("serve logged %q, want the file in %s", logs, spill)
	}
	if ents, _ := os.ReadDir(spill); len(ents) != 0 {
		t.Errorf("the spill directory holds %d entries, want none (unlinked)", len(ents))
	}
}

// TestServeAsFileRefused: a peer that cannot be handed a file (here this
// very process, which cannot trace itself) fails the serve, naming the
// file and why, instead of serving CRIU a pipe it would misread.
func TestServeAsFileRefused(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	src, _ := hugeFixture(t, ctx)
	dir := shortDir(t)
	listening := make(chan struct{})
	var serveErr error
	served := make(chan struct{})
	go func() {
		defer close(served)
		_, serveErr = ServeWith(ctx, dir, src, ServeOptions{Hooks: Hooks{Listening: func() { close(listening) }}})
	}()
	<-listening
	nc, err := net.Dial("unix", filepath.Join(dir, ServeSocket))
	if err != nil {
		t.Fatal(err)
	}
	req, _ := EncodeRequest("nftables-3.img")
	if _, err := nc.Write(req); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadReply(nc); err == nil {
		t.Error("got a reply; want the connection closed")
	}
	nc.Close()
	<-served
	if !errors.Is(serveErr, fdgraft.ErrUnsupported) || !strings.Contains(serveErr.Error(), "nftables-3.img as a file (criu sizes it with fstat)") {
		t.Fatalf("serve: %v; want it to fail naming the file, why, and ErrUnsupported", serveErr)
	}
}

func TestSkippedSpans(t *testing.T) {
	const p = pageSize
	huge := []vmaRange{{0x200000, 0x400000}}
	for _, c := range []struct {
		name    string
		entries []pagemapEntry
		vmas    []vmaRange
		want    []source.Span
	}{
		{"none", []pagemapEntry{{0x1000, 4, pePresent}}, nil, nil},
		{"first", []pagemapEntry{{0x200000, 2, pePresent}, {0x1000000, 3, pePresent}}, huge, []source.Span{sp(0, 2*p)}},
		{"middle", []pagemapEntry{{0x1000, 1, pePresent}, {0x200000, 2, pePresent}, {0x1000000, 3, pePresent}}, huge, []source.Span{sp(p, 2*p)}},
		{"an entry across its end", []pagemapEntry{{0x3fe000, 4, pePresent}}, huge, []source.Span{sp(0, 2*p)}},
		{"an entry across its start", []pagemapEntry{{0x1fe000, 4, pePresent}}, huge, []source.Span{sp(2*p, 2*p)}},
		{"two entries in it merge", []pagemapEntry{{0x200000, 1, pePresent}, {0x201000, 1, pePresent}}, huge, []source.Span{sp(0, 2*p)}},
		{"two mappings", []pagemapEntry{{0x200000, 1, pePresent}, {0x1000, 0, pePresent}, {0x600000, 1, pePresent}, {0x800000, 1, pePresent}},
			[]vmaRange{{0x200000, 0x400000}, {0x800000, 0xa00000}}, []source.Span{sp(0, p), sp(2*p, p)}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := skippedSpans(c.entries, c.vmas)
			if len(got) != len(c.want) || (len(got) > 0 && !equalSpans(got, c.want)) {
				t.Fatalf("got %v, want %v", got, c.want)
			}
		})
	}
}

func equalSpans(a, b []source.Span) bool {
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestNotPremapped(t *testing.T) {
	got, err := notPremapped(mmImg(t,
		vma{0x1000, 0x3000, heap, 0x22},
		vma{0x800000, 0xa00000, anon, mapHugeTLB | 0x22},
		vma{0x200000, 0x400000, anon | vmaExtPlugin, 0x22},
		vma{0x500000, 0x400000, anon, mapHugeTLB}, // backwards: left out
	))
	if err != nil {
		t.Fatal(err)
	}
	want := []vmaRange{{0x200000, 0x400000}, {0x800000, 0xa00000}}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("got %v, want %v", got, want)
	}
}

func FuzzNotPremapped(f *testing.F) {
	f.Add(mmImg(f, vma{0x1000, 0x3000, heap, 0x22}, vma{0x800000, 0xa00000, anon, mapHugeTLB}))
	f.Add(image(mmMagic))
	f.Fuzz(func(t *testing.T, b []byte) {
		vmas, err := notPremapped(b)
		if err != nil {
			return
		}
		for i, v := range vmas {
			if v.start >= v.end || v.start%pageSize != 0 || v.end%pageSize != 0 || (i > 0 && vmas[i-1].start > v.start) {
				t.Fatalf("VMA %d: %+v", i, v)
			}
		}
		// Whatever the pagemap, the spans are sorted and disjoint.
		spans := skippedSpans([]pagemapEntry{{0, 1 << 20, pePresent}, {1 << 40, 1 << 10, pePresent}}, vmas)
		if _, err := source.NewOmit(io.Discard, spans); err != nil {
			t.Fatal(err)
		}
	})
}

// TestSpansWriter: the bytes of a file handed over in pieces of any size
// land at their offsets where they lie in the spans, nowhere else.
func TestSpansWriter(t *testing.T) {
	data := amdPages(1000, 5)
	spans := []source.Span{sp(3, 10), sp(100, 1), sp(500, 400)}
	for _, piece := range []int{1, 7, 64, 1000} {
		f, err := os.CreateTemp(t.TempDir(), "spans")
		if err != nil {
			t.Fatal(err)
		}
		w := &spansWriter{f: f, spans: spans}
		for off := 0; off < len(data); off += piece {
			if n, err := w.Write(data[off:min(len(data), off+piece)]); err != nil || n != min(piece, len(data)-off) {
				t.Fatalf("write: %d %v", n, err)
			}
		}
		got := make([]byte, len(data))
		f.ReadAt(got, 0)
		f.Close()
		want := make([]byte, len(data))
		for _, s := range spans {
			copy(want[s.Off:s.End()], data[s.Off:s.End()])
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("pieces of %d: the file differs", piece)
		}
	}
}

func TestWhyAsFile(t *testing.T) {
	fi := newFileImages(nil, ServeOptions{})
	for _, c := range []struct {
		name string
		file bool
	}{
		{"nftables-9.img", true},
		{"nftables-9.img", true},
		{"pages-1.img", false},
		{"pages-1.img", true},
		{"pages-1.img", true},
		{"pages-2.img", false},
		{"iptables-9.img", false},
		{"ghost-file-1.img", false},
		{"inventory.img", false},
		{"nftables-9.img.bak", false},
	} {
		if got := fi.why(c.name, 100) != ""; got != c.file {
			t.Errorf("%s: as a file %v, want %v", c.name, got, c.file)
		}
	}
	// A measuring build (asfile_measure.go) serves small files as files
	// too, but never a ghost file's image or a pages image's first read.
	defer func(n int64) { smallAsFile = n }(smallAsFile)
	smallAsFile = 4096
	for _, c := range []struct {
		name string
		size int64
		file bool
	}{
		{"core-1.img", 100, true},
		{"core-1.img", 4096, false},
		{"ghost-file-1a.img", 100, false},
		{"pages-7.img", 100, false},
	} {
		if got := fi.why(c.name, c.size) != ""; got != c.file {
			t.Errorf("%s of %d bytes, small files under %d: as a file %v, want %v", c.name, c.size, smallAsFile, got, c.file)
		}
	}
}
