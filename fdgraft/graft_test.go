package fdgraft

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The tests run a client that asks for a file the way CRIU's stream mode
// does (criu/img-streamer.c): a request, a blocking read of the reply, a
// pipe whose write end goes over the socket; then it reports what its
// read end is. It is this test binary again, started twice so that it is
// not this process's child.
const helperEnv = "GPUCR_FDGRAFT_CLIENT"

func TestMain(m *testing.M) {
	switch os.Getenv(helperEnv) {
	case "":
		os.Exit(m.Run())
	case "start":
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), helperEnv+"=run")
		cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
		if err := cmd.Start(); err != nil {
			panic(err)
		}
		os.Exit(0)
	default:
		report, err := client(os.Getenv("GPUCR_FDGRAFT_SOCKET"))
		if err != nil {
			report.Error = err.Error()
		}
		json.NewEncoder(os.Stdout).Encode(report)
		os.Exit(0)
	}
}

type clientReport struct {
	Size    int64  `json:"size"`
	Content string `json:"content"`
	At3     string `json:"at3"` // pread of 5 bytes at offset 3
	IsFile  bool   `json:"is_file"`
	// Traced: with GPUCR_FDGRAFT_STALL=1 the client, once answered, waits
	// for a byte on its stdin instead of making a pipe, then says whether
	// it is still traced.
	Traced bool   `json:"traced"`
	Error  string `json:"error"`
}

func client(path string) (clientReport, error) {
	var r clientReport
	runtime.LockOSThread()
	s, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		return r, err
	}
	if err := syscall.Connect(s, &syscall.SockaddrUnix{Name: path}); err != nil {
		return r, err
	}
	req := []byte("\x04\x00\x00\x00name")
	if _, err := syscall.Write(s, req); err != nil {
		return r, err
	}
	var n [4]byte
	if err := readFull(s, n[:]); err != nil {
		return r, err
	}
	if err := readFull(s, make([]byte, binary.LittleEndian.Uint32(n[:]))); err != nil {
		return r, err
	}
	if os.Getenv("GPUCR_FDGRAFT_STALL") == "1" {
		if err := readFull(0, make([]byte, 1)); err != nil {
			return r, err
		}
		b, err := os.ReadFile("/proc/thread-self/status")
		r.Traced = err != nil || !strings.Contains(string(b), "TracerPid:\t0\n")
		return r, err
	}
	var p [2]int
	if err := syscall.Pipe(p[:]); err != nil {
		return r, err
	}
	if err := syscall.Sendmsg(s, []byte{0}, syscall.UnixRights(p[1]), nil, 0); err != nil {
		return r, err
	}
	syscall.Close(p[1])
	var st syscall.Stat_t
	if err := syscall.Fstat(p[0], &st); err != nil {
		return r, err
	}
	r.Size, r.IsFile = st.Size, st.Mode&syscall.S_IFMT == syscall.S_IFREG
	at := make([]byte, 5)
	if k, err := syscall.Pread(p[0], at, 3); err == nil {
		r.At3 = string(at[:k])
	}
	all, err := io.ReadAll(os.NewFile(uintptr(p[0]), "image"))
	r.Content = string(all)
	return r, err
}

func readFull(fd int, b []byte) error {
	for len(b) > 0 {
		n, err := syscall.Read(fd, b)
		if err != nil {
			return err
		}
		if n == 0 {
			return io.ErrUnexpectedEOF
		}
		b = b[n:]
	}
	return nil
}

// startClient starts the client and returns its connection, its request
// read, and its report to come.
// startClient starts a client (stdin: its standard input, nil for none).
func startClient(t *testing.T, stdin *os.File, env ...string) (*net.UnixConn, <-chan clientReport) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("tracing another process needs root") // unit test of one package
	}
	path := filepath.Join(t.TempDir(), "s.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(append(os.Environ(), helperEnv+"=start", "GPUCR_FDGRAFT_SOCKET="+path), env...)
	out, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { out.Close() })
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, w, os.Stderr
	err = cmd.Start()
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	reports := make(chan clientReport, 1)
	go func() {
		var r clientReport
		if err := json.NewDecoder(bufio.NewReader(out)).Decode(&r); err != nil {
			r.Error = "no report: " + err.Error()
		}
		reports <- r
	}()
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	conn, err := l.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	req := make([]byte, 8)
	if _, err := io.ReadFull(conn, req); err != nil {
		t.Fatal(err)
	}
	return conn, reports
}

func reply(conn *net.UnixConn) func() error {
	return func() error {
		_, err := conn.Write([]byte("\x02\x00\x00\x00ok"))
		return err
	}
}

func memfdWith(t *testing.T, content string) *os.File {
	t.Helper()
	fd, err := unix.MemfdCreate("graft-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "memfd")
	t.Cleanup(func() { f.Close() })
	if _, err := f.WriteString(content); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		t.Fatal(err)
	}
	return f
}

// recvPipe takes the write end the client sends after its pipe(2).
func recvPipe(t *testing.T, conn *net.UnixConn) *os.File {
	t.Helper()
	oob := make([]byte, unix.CmsgSpace(4))
	_, oobn, _, _, err := conn.ReadMsgUnix(make([]byte, 1), oob)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		t.Fatalf("no descriptor: %v", err)
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		t.Fatalf("no descriptor: %v", err)
	}
	return os.NewFile(uintptr(fds[0]), "pipe")
}

func TestHandReplacesThePipe(t *testing.T) {
	conn, reports := startClient(t, nil)
	const content = "hello, grafted world"
	f := memfdWith(t, content)
	ctx := context.Background()
	task, err := Stop(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	ino, err := task.Hand(ctx, f, reply(conn))
	if err != nil {
		t.Fatal(err)
	}
	w := recvPipe(t, conn)
	defer w.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(w.Fd()), &st); err != nil || st.Ino != ino {
		t.Errorf("the write end sent is pipe %d (%v), the replaced one %d", st.Ino, err, ino)
	}
	f.Close() // the client holds its own copy
	r := <-reports
	if r.Error != "" {
		t.Fatal(r.Error)
	}
	want := clientReport{Size: int64(len(content)), Content: content, At3: content[3:8], IsFile: true}
	if r != want {
		t.Errorf("client saw %+v, want %+v", r, want)
	}
}

func TestReleaseLeavesThePipe(t *testing.T) {
	conn, reports := startClient(t, nil)
	ctx := context.Background()
	task, err := Stop(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	task.Release()
	if err := reply(conn)(); err != nil {
		t.Fatal(err)
	}
	w := recvPipe(t, conn)
	if _, err := w.WriteString("through the pipe"); err != nil {
		t.Fatal(err)
	}
	w.Close()
	r := <-reports
	if r.Error != "" {
		t.Fatal(r.Error)
	}
	if r.IsFile || r.Size != 0 || r.Content != "through the pipe" {
		t.Errorf("client saw %+v, want the pipe's bytes and no size", r)
	}
}

// TestHandGivesUp: a task that never makes its pipe is woken once the
// time is up and let go; Hand fails instead of waiting for ever.
func TestHandGivesUp(t *testing.T) {
	stdin, release, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer stdin.Close()
	defer release.Close()
	conn, reports := startClient(t, stdin, "GPUCR_FDGRAFT_STALL=1")
	defer func(d time.Duration) { handFor = d }(handFor)
	handFor = time.Millisecond
	ctx := context.Background()
	task, err := Stop(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	_, err = task.Hand(ctx, memfdWith(t, "never read"), reply(conn))
	if err == nil || !strings.Contains(err.Error(), "not done within") {
		t.Fatalf("Hand: %v, want it to give up", err)
	}
	release.Write([]byte{1})
	r := <-reports
	if r.Error != "" || r.Traced {
		t.Fatalf("client after Hand gave up: %+v, want it let go", r)
	}
}

func TestStopRefusesOwnChild(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	path := filepath.Join(t.TempDir(), "s.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), helperEnv+"=run", "GPUCR_FDGRAFT_SOCKET="+path)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	conn, err := l.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := io.ReadFull(conn, make([]byte, 8)); err != nil {
		t.Fatal(err)
	}
	_, err = Stop(context.Background(), conn)
	if !errors.Is(err, ErrUnsupported) {
		t.Errorf("Stop of its own child: %v, want ErrUnsupported", err)
	}
	conn.Close()
	cmd.Wait()
}

func TestDiagAttr(t *testing.T) {
	attr := func(typ uint16, v []byte) []byte {
		b := make([]byte, 4, 4+len(v)+3)
		binary.NativeEndian.PutUint16(b, uint16(4+len(v)))
		binary.NativeEndian.PutUint16(b[2:], typ)
		b = append(b, v...)
		for len(b)%4 != 0 {
			b = append(b, 0)
		}
		return b
	}
	peer := []byte{1, 2, 3, 4}
	for _, c := range []struct {
		name string
		in   []byte
		ok   bool
	}{
		{"alone", attr(unixDiagPeer, peer), true},
		{"after another", append(attr(0, []byte("name!")), attr(unixDiagPeer, peer)...), true},
		{"absent", attr(0, []byte("x")), false},
		{"truncated", attr(unixDiagPeer, peer)[:6], false},
		{"zero length", []byte{0, 0, 2, 0, 1, 2, 3, 4}, false},
		{"empty", nil, false},
	} {
		got, ok := diagAttr(c.in, unixDiagPeer)
		if ok != c.ok || (ok && string(got) != string(peer)) {
			t.Errorf("%s: %v %v", c.name, got, ok)
		}
	}
}
