package criusock

import (
	"bytes"
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/testwait"
)

// Under umask 000 the sockets were srwxrwxrwx: any local user could pull
// the target's memory from serve or push images into a capture. They are
// 0600 whatever the umask, and the owner still connects.
func TestSocketPrivateUnderUmask000(t *testing.T) {
	old := syscall.Umask(0)
	defer syscall.Umask(old)
	dir := shortDir(t)
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{CaptureSocket, ServeSocket} {
		path := filepath.Join(dir, name)
		l, err := listen(dir, name)
		if err != nil {
			t.Fatal(err)
		}
		st, err := os.Lstat(path)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode()&os.ModeSocket == 0 || st.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want a socket of mode 0600", name, st.Mode())
		}
		c, err := net.Dial("unix", path)
		if err != nil {
			t.Fatalf("%s: the owner cannot connect: %v", name, err)
		}
		c.Close()
		l.Close()
		if _, err := os.Lstat(path); !os.IsNotExist(err) {
			t.Errorf("%s left behind after Close: %v", name, err)
		}
	}
}

// longDir is a directory whose path is about n bytes.
func longDir(t *testing.T, n int) string {
	t.Helper()
	dir := shortDir(t)
	for len(dir) < n-40 {
		dir = filepath.Join(dir, "podman-overlay-containers-userdata")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestLongImagesDir: an images dir whose socket paths exceed sun_path (a
// Podman container's is about 150 bytes) is listened on and connected to
// through a descriptor of the directory, on both sides: an intake takes a
// CRIU's files and a serve hands them back; ReachableDir gives CRIU a
// short path to the same sockets; Close removes the socket files.
func TestLongImagesDir(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	dir := longDir(t, 200)
	if len(filepath.Join(dir, CaptureSocket)) < MaxSocketPath+80 {
		t.Fatalf("test dir %s too short", dir)
	}
	c, stream := newCapture(t, ctx)
	in, err := StartIntakeWith(ctx, dir, c, IntakeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	short, release, err := ReachableDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(filepath.Join(short, CaptureSocket)) >= MaxSocketPath {
		t.Fatalf("ReachableDir(%s) = %s: still too long", dir, short)
	}
	criu, err := net.Dial("unix", filepath.Join(short, CaptureSocket)) // as CRIU connects
	release()
	if err != nil {
		t.Fatalf("connect through %s: %v", short, err)
	}
	cl := &Client{conn: criu.(*net.UnixConn)}
	want := map[string]string{"pages-1.img": strings.Repeat("p", 100000), "inventory.img": "inv"}
	for _, n := range []string{"pages-1.img", "inventory.img"} {
		if err := cl.Push(ctx, n, strings.NewReader(want[n])); err != nil {
			t.Fatal(err)
		}
	}
	cl.Close()
	if _, err := in.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(filepath.Join(dir, CaptureSocket)); !os.IsNotExist(err) {
		t.Errorf("capture socket left behind: %v", err)
	}
	src := source.NewStreamSource(ctx, []io.Reader{stream}, []string{"stream"}, source.StreamSourceOptions{})
	defer src.Close()
	served := make(chan error, 1)
	go func() {
		_, err := ServeWith(ctx, dir, src, ServeOptions{})
		served <- err
	}()
	var conn *net.UnixConn
	for conn == nil {
		if conn, err = dialIn(ctx, dir, ServeSocket); err != nil {
			time.Sleep(10 * time.Millisecond) // serve reads the stream whole first
		}
	}
	rd := &Client{conn: conn}
	for n, body := range want {
		var got bytes.Buffer
		if _, err := rd.Pull(ctx, n, &got); err != nil || got.String() != body {
			t.Fatalf("pull %s: %d bytes, %v", n, got.Len(), err)
		}
	}
	rd.Close()
	if err := <-served; err != nil {
		t.Fatal(err)
	}
}
