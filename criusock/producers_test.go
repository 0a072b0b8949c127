package criusock

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/testwait"
)

func shortDir(t testing.TB) string {
	t.Helper()
	d, err := os.MkdirTemp("/tmp", "gcp-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// amdPages is an amdgpu-pages-style file: an 8-byte size prefix, then data.
func amdPages(n int, seed uint64) []byte {
	b := make([]byte, 8+n)
	binary.LittleEndian.PutUint64(b, uint64(n))
	r := rand.New(rand.NewPCG(seed, 7))
	for i := 8; i < len(b); i += 8 {
		v := r.Uint64()
		for j := 0; j < 8 && i+j < len(b); j++ {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	return b
}

// newCapture captures into a stream held in memory.
func newCapture(t testing.TB, ctx context.Context) (*streamer.Capture, *bytes.Buffer) {
	t.Helper()
	var buf bytes.Buffer
	out, err := streamer.NewStreamOutput([]io.Writer{&buf})
	if err != nil {
		t.Fatal(err)
	}
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{ChunkSize: 256 << 10, Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	return c, &buf
}

// TestIntakeProducers: producers push files beside a CRIU-like connection;
// the image is complete only when CRIU sent inventory.img and every
// producer (at least Producers of them) closed cleanly; a producer that
// comes later is refused; serving gives producers their files back.
func TestIntakeProducers(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	dir := shortDir(t)
	c, stream := newCapture(t, ctx)
	in, err := StartIntakeWith(ctx, dir, c, IntakeOptions{Producers: 2})
	if err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{
		"amdgpu-pages-1-0.img": amdPages(3<<20, 1),
		"amdgpu-pages-1-1.img": amdPages(2<<20+5, 2),
		"vram-dump-0.bin":      amdPages(1<<20, 3),
	}
	// Producer 1 pushes two files at once over one connection.
	p1, err := DialProducer(ctx, dir, "amd-threads")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for _, n := range []string{"amdgpu-pages-1-0.img", "amdgpu-pages-1-1.img"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := p1.Push(ctx, n, bytes.NewReader(files[n])); err != nil {
				t.Error(err)
			}
		}()
	}
	// CRIU sends its images, inventory.img last, and keeps the socket open
	// (as it does until after its post-dump action).
	criu, err := Dial(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"pages-1.img", "inventory.img"} {
		if err := criu.Push(ctx, n, strings.NewReader("criu "+n)); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	p1.Close()
	// One producer of two: not complete.
	short, cancelShort := context.WithTimeout(ctx, 300*time.Millisecond)
	if _, err := in.Drained(short); err == nil {
		t.Fatal("Drained returned with one of two producers")
	}
	cancelShort()
	p2, err := DialProducer(ctx, dir, "gpu-dumper")
	if err != nil {
		t.Fatal(err)
	}
	if err := p2.Push(ctx, "vram-dump-0.bin", bytes.NewReader(files["vram-dump-0.bin"])); err != nil {
		t.Fatal(err)
	}
	p2.Close()
	res, err := in.Drained(ctx)
	if err != nil || !res.Complete || res.Producers != 2 || res.ProducerFiles != 3 {
		t.Fatalf("Drained = %+v, %v", res, err)
	}
	// Sealed: a late producer's push does not get in.
	if late, err := DialProducer(ctx, dir, "late"); err == nil {
		late.Close()
		t.Fatal("a producer was taken on after the image was sealed")
	} else {
		t.Logf("late producer: %v", err)
	}
	criu.Close()
	res, err = in.Wait(ctx)
	if err != nil || res.Files != 5 {
		t.Fatalf("Wait = %+v, %v", res, err)
	}
	m, err := c.Close(ctx, manifest.Manifest{})
	if err != nil {
		t.Fatal(err)
	}
	ext := map[string]bool{}
	for _, f := range m.Files {
		ext[f.Name] = f.External
	}
	if len(m.Files) != 5 || !ext["amdgpu-pages-1-0.img"] || !ext["vram-dump-0.bin"] || ext["pages-1.img"] {
		t.Fatalf("manifest files %+v", ext)
	}
	if _, ok := ext["late.bin"]; ok {
		t.Fatal("the late producer's file got into the image")
	}

	// Restore side: CRIU's connection and a producer's pull, at once; serve
	// waits for the one producer it is told of.
	src := source.NewStreamSource(ctx, []io.Reader{bytes.NewReader(stream.Bytes())}, []string{"mem"}, source.StreamSourceOptions{})
	defer src.Close()
	sdir := shortDir(t)
	listening := make(chan struct{})
	var serveRes ServeResult
	var serveErr error
	served := make(chan struct{})
	go func() {
		defer close(served)
		serveRes, serveErr = ServeWith(ctx, sdir, src, ServeOptions{Hooks: Hooks{Listening: func() { close(listening) }}, Producers: 1})
	}()
	<-listening
	conn, err := net.Dial("unix", filepath.Join(sdir, ServeSocket))
	if err != nil {
		t.Fatal(err)
	}
	criuR := &Client{conn: conn.(*net.UnixConn)}
	var got bytes.Buffer
	if _, err := criuR.Pull(ctx, "inventory.img", &got); err != nil || got.String() != "criu inventory.img" {
		t.Fatalf("criu pull: %q %v", got.String(), err)
	}
	if _, err := criuR.Pull(ctx, "absent.img", io.Discard); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("pull of an absent file: %v", err)
	}
	criuR.Close()
	select {
	case <-served:
		t.Fatal("serve ended before the producer it waits for came")
	case <-time.After(200 * time.Millisecond):
	}
	pr, err := DialPull(ctx, sdir, "amd-threads")
	if err != nil {
		t.Fatal(err)
	}
	for n, want := range files {
		wg.Add(1)
		go func() {
			defer wg.Done()
			h := sha256.New()
			if _, err := pr.Pull(ctx, n, h); err != nil {
				t.Error(err)
				return
			}
			if w := sha256.Sum256(want); !bytes.Equal(h.Sum(nil), w[:]) {
				t.Errorf("%s differs after the round trip", n)
			}
		}()
	}
	wg.Wait()
	pr.Close()
	<-served
	if serveErr != nil || serveRes.Producers != 1 || serveRes.Served != 4 {
		t.Fatalf("serve: %+v %v", serveRes, serveErr)
	}
}

// A producer that fails (or sends CRIU's inventory.img) fails the intake,
// which closes CRIU's connection so that its dump fails too.
func TestIntakeProducerFailure(t *testing.T) {
	for _, how := range []string{"abort", "inventory"} {
		t.Run(how, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(30*time.Second))
			defer cancel()
			dir := shortDir(t)
			c, _ := newCapture(t, ctx)
			in, err := StartIntakeWith(ctx, dir, c, IntakeOptions{Producers: 1})
			if err != nil {
				t.Fatal(err)
			}
			criu, err := Dial(ctx, dir)
			if err != nil {
				t.Fatal(err)
			}
			if err := criu.Push(ctx, "pages-1.img", strings.NewReader("pages")); err != nil {
				t.Fatal(err)
			}
			p, err := DialProducer(ctx, dir, "dumper")
			if err != nil {
				t.Fatal(err)
			}
			switch how {
			case "abort":
				if err := p.Push(ctx, "vram.bin", strings.NewReader("half")); err != nil {
					t.Fatal(err)
				}
				p.Abort()
			case "inventory":
				p.Push(ctx, "inventory.img", strings.NewReader("fake"))
				p.Close()
			}
			res, err := in.Drained(ctx)
			if err == nil {
				t.Fatalf("Drained = %+v after a producer failure", res)
			}
			t.Logf("%s: %v", how, err)
			// CRIU's connection is closed: its next request fails.
			deadline := time.Now().Add(testwait.Scale(5 * time.Second))
			for time.Now().Before(deadline) {
				if err := criu.Push(ctx, "core-1.img", strings.NewReader("x")); err != nil {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			criu.Close()
			if _, err := in.Wait(ctx); err == nil {
				t.Fatal("Wait succeeded after a producer failure")
			}
			c.Abort(errors.New("test"))
			c.Close(ctx, manifest.Manifest{})
		})
	}
}

func TestProducerHello(t *testing.T) {
	h, err := ProducerHello("amd")
	if err != nil || !ValidImageName(h) {
		t.Fatalf("hello %q %v", h, err)
	}
	if n, ok := ParseProducerHello(h); !ok || n != "amd" {
		t.Fatalf("parse %q: %q %v", h, n, ok)
	}
	if _, ok := ParseProducerHello("inventory.img"); ok {
		t.Fatal("CRIU's image taken for a hello")
	}
	for _, bad := range []string{"", "a/b", "x\ny", strings.Repeat("x", 300)} {
		if _, err := ProducerHello(bad); err == nil {
			t.Errorf("ProducerHello(%q) accepted", bad)
		}
	}
}
