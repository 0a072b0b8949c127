package criusock

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/testwait"
)

// earlyStream is a stream holding big.img (8 MiB, incompressible: more
// than any pipe buffer holds) and small.img.
func earlyStream(t *testing.T, ctx context.Context) (big []byte, stream []byte) {
	t.Helper()
	big = make([]byte, 8<<20)
	rand.Read(big)
	c, buf := newCapture(t, ctx)
	for name, b := range map[string][]byte{"big.img": big, "small.img": []byte("small")} {
		if _, err := c.WriteFile(name, bytes.NewReader(b), false); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		t.Fatal(err)
	}
	return big, buf.Bytes()
}

// askAndClose asks for name as CRIU does, takes the first n bytes of it
// and closes the pipe (closeConn: the connection first).
func askAndClose(t *testing.T, conn *net.UnixConn, name string, n int, closeConn bool) []byte {
	t.Helper()
	req, err := EncodeRequest(name)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Write(req); err != nil {
		t.Fatal(err)
	}
	if ok, err := ReadReply(conn); err != nil || !ok {
		t.Fatalf("reply for %s: %v %v", name, ok, err)
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Close()
	err = SendPipe(conn, pw)
	pw.Close()
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, n)
	if _, err := io.ReadFull(pr, got); err != nil {
		t.Fatal(err)
	}
	if closeConn {
		conn.Close()
		time.Sleep(100 * time.Millisecond) // the serve's writer still waits on the pipe
	}
	return got
}

// TestServeEarlyClose: CRIU may close a file's pipe before taking all of
// it (part of a pages-N.img skipped). That
// is its decision: the serve logs the file and the bytes not taken and
// serves the rest. A connection that closes with a file not taken fails
// the serve.
func TestServeEarlyClose(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	big, stream := earlyStream(t, ctx)
	for _, c := range []struct {
		name      string
		take      []int // bytes of big.img taken by each request, in turn
		closeConn bool  // the connection closes before the pipe
		wantErr   error
	}{
		{name: "nothing taken", take: []int{0}},
		{name: "part taken", take: []int{3 << 20}},
		{name: "both, then again whole", take: []int{0, 1 << 20, len(big)}},
		{name: "disconnected with the file outstanding", take: []int{1 << 20}, closeConn: true, wantErr: ErrOutstanding},
	} {
		t.Run(c.name, func(t *testing.T) {
			src := source.NewStreamSource(ctx, []io.Reader{bytes.NewReader(stream)}, []string{"mem"}, source.StreamSourceOptions{})
			defer src.Close()
			dir := shortDir(t)
			listening := make(chan struct{})
			var mu sync.Mutex
			var logs []string
			var res ServeResult
			var serveErr error
			served := make(chan struct{})
			go func() {
				defer close(served)
				res, serveErr = ServeWith(ctx, dir, src, ServeOptions{Hooks: Hooks{
					Listening: func() { close(listening) },
					Log: func(s string) {
						mu.Lock()
						logs = append(logs, s)
						mu.Unlock()
					},
				}})
			}()
			<-listening
			nc, err := net.Dial("unix", filepath.Join(dir, ServeSocket))
			if err != nil {
				t.Fatal(err)
			}
			conn := nc.(*net.UnixConn)
			var want []string
			whole := 0
			for _, n := range c.take {
				got := askAndClose(t, conn, "big.img", n, c.closeConn)
				if !bytes.Equal(got, big[:n]) {
					t.Fatalf("the first %d bytes of big.img differ", n)
				}
				if n < len(big) {
					want = append(want, fmt.Sprintf("big.img: closed by its reader with %d of %d bytes not taken; serving the rest", len(big)-n, len(big)))
				} else {
					whole++
				}
			}
			if !c.closeConn {
				// The rest is still served.
				var small bytes.Buffer
				if _, err := (&Client{conn: conn}).Pull(ctx, "small.img", &small); err != nil || small.String() != "small" {
					t.Fatalf("small.img after an early close: %q %v", small.String(), err)
				}
				// CRIU goes on restoring for a while after an early close:
				// the serve has noticed it by the time CRIU disconnects.
				for deadline := time.Now().Add(testwait.Scale(10 * time.Second)); ; time.Sleep(10 * time.Millisecond) {
					mu.Lock()
					n := len(logs)
					mu.Unlock()
					if n >= len(want) || time.Now().After(deadline) {
						break
					}
				}
				conn.Close()
			}
			<-served
			if c.wantErr != nil {
				if !errors.Is(serveErr, c.wantErr) {
					t.Fatalf("serve: %v, want %v", serveErr, c.wantErr)
				}
				t.Logf("serve: %v", serveErr)
				return
			}
			if serveErr != nil {
				t.Fatal(serveErr)
			}
			if res.ClosedEarly != len(want) || res.Served != whole+1 {
				t.Fatalf("serve result %+v, want %d closed early and %d served", res, len(want), whole+1)
			}
			mu.Lock()
			defer mu.Unlock()
			// Each file is served on its own goroutine: any order.
			sort.Strings(logs)
			sort.Strings(want)
			if strings.Join(logs, "\n") != strings.Join(want, "\n") {
				t.Fatalf("logged\n%s\nwant\n%s", strings.Join(logs, "\n"), strings.Join(want, "\n"))
			}
		})
	}
}
