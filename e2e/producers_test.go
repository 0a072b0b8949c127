package e2e

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/criusock"
)

// vramFile is a producer's file: AMD's amdgpu-pages layout (an 8-byte
// little-endian size, then the buffer contents), generated from a seed so
// that it is checked by digest without being kept in memory.
type vramFile struct {
	name string
	size int64 // data bytes after the prefix
	seed uint64
}

func (v vramFile) reader() io.Reader {
	var prefix [8]byte
	binary.LittleEndian.PutUint64(prefix[:], uint64(v.size))
	return io.MultiReader(bytes.NewReader(prefix[:]), io.LimitReader(&rngReader{r: rand.New(rand.NewPCG(v.seed, 99))}, v.size))
}

func (v vramFile) digest() [32]byte {
	h := sha256.New()
	io.Copy(h, v.reader())
	var d [32]byte
	copy(d[:], h.Sum(nil))
	return d
}

// rngReader is VRAM-like content: half of every 64 KiB block bf16 weights
// (compressible by the byte-plane codecs), half noise.
type rngReader struct {
	r   *rand.Rand
	buf []byte
}

func (g *rngReader) Read(p []byte) (int, error) {
	if len(g.buf) == 0 {
		g.buf = make([]byte, 64<<10)
		for i := 0; i < len(g.buf)/2; i += 2 {
			// bf16 of a small normal value: sign, exponent near 0x3c.
			f := g.r.NormFloat64() * 0.02
			bits := uint16(0x3c00 + uint16(int(f*4096)&0x3ff))
			if f < 0 {
				bits |= 0x8000
			}
			binary.LittleEndian.PutUint16(g.buf[i:], bits)
		}
		for i := len(g.buf) / 2; i < len(g.buf); i += 8 {
			binary.LittleEndian.PutUint64(g.buf[i:], g.r.Uint64())
		}
	}
	n := copy(p, g.buf)
	g.buf = g.buf[n:]
	return n, nil
}

func fileDigest(t *testing.T, p string) [32]byte {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	var d [32]byte
	copy(d[:], h.Sum(nil))
	return d
}

// TestProducersWithCRIU: while `gpucr-stream checkpoint` runs a real criu
// dump of the target, three producers push VRAM files into the same image
// at once (two over one connection, one through `vram push`): several
// hundred MB, amdgpu-pages layout. The checkpoint waits for them
// (--producers 3). Then `restore` brings the target back while a producer
// pulls every file back concurrently, and `extract` writes them out: all
// byte-identical, the target intact.
func TestProducersWithCRIU(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 64)
	bin := BuildBinary(t, "./cmd/gpucr-stream")
	files := []vramFile{
		{"amdgpu-pages-1-0.img", 300 << 20, 1},
		{"amdgpu-pages-1-1.img", 300<<20 + 4097, 2},
		{"amdgpu-pages-2-0.img", 200 << 20, 3},
		{"vram-extra.bin", 48<<20 + 1, 4},
	}
	want := map[string][32]byte{}
	for _, f := range files {
		want[f.name] = f.digest()
	}
	// The CLI producer pushes from a file.
	extraPath := filepath.Join(dir, "vram-extra.bin")
	ef, err := os.Create(extraPath)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(ef, files[3].reader())
	ef.Close()

	archive := filepath.Join(dir, "archive")
	work := mkdir(t, filepath.Join(dir, "w"))
	var ckOut bytes.Buffer
	ck := startGCS(ctx, t, gcsOpts{stdout: &ckOut}, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", archive,
		"--work-dir", work, "--producers", "3", "--codec", "auto", "--chunk-size", "1MiB", "--json")
	images := filepath.Join(work, "img")
	waitForFile(ctx, t, filepath.Join(images, criusock.CaptureSocket))

	var wg sync.WaitGroup
	errs := make(chan error, 8)
	producer := func(name string, fs ...vramFile) {
		defer wg.Done()
		cl, err := criusock.DialProducer(ctx, images, name)
		if err != nil {
			errs <- err
			return
		}
		var pw sync.WaitGroup
		for _, f := range fs {
			pw.Add(1)
			go func() {
				defer pw.Done()
				if err := cl.Push(ctx, f.name, f.reader()); err != nil {
					errs <- err
				}
			}()
		}
		pw.Wait()
		cl.Close()
	}
	wg.Add(2)
	go producer("amd-gpu1", files[0], files[1])
	go producer("amd-gpu2", files[2])
	push := exec.CommandContext(ctx, bin, "vram", "push", "--images-dir", images, files[3].name, extraPath)
	if out, err := push.CombinedOutput(); err != nil {
		t.Fatalf("vram push: %v: %s", err, out)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if err := ck.wait(ctx); err != nil {
		t.Fatal(err)
	}
	var res struct {
		Files     int   `json:"files"`
		RawBytes  int64 `json:"raw_bytes"`
		Producers int   `json:"producers"`
	}
	if err := json.Unmarshal(ckOut.Bytes(), &res); err != nil || res.Producers != 3 || res.RawBytes < 848<<20 {
		t.Fatalf("checkpoint result %s: %v", ckOut.String(), err)
	}
	t.Logf("checkpoint: %s", ckOut.String())
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatal(err)
	}

	// Restore: CRIU and a producer pulling its files back, at once.
	work2 := mkdir(t, filepath.Join(dir, "w2"))
	var rsOut bytes.Buffer
	rs := startGCS(ctx, t, gcsOpts{stdout: &rsOut}, "restore", "--from", archive, "--work-dir", work2, "--producers", "1")
	serveDir := filepath.Join(work2, "img")
	waitForFile(ctx, t, filepath.Join(serveDir, criusock.ServeSocket))
	cl, err := criusock.DialPull(ctx, serveDir, "amd-restore")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][32]byte{}
	var mu sync.Mutex
	for _, f := range files {
		wg.Add(1)
		go func() {
			defer wg.Done()
			h := sha256.New()
			if _, err := cl.Pull(ctx, f.name, h); err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			var d [32]byte
			copy(d[:], h.Sum(nil))
			got[f.name] = d
			mu.Unlock()
		}()
	}
	wg.Wait()
	cl.Close()
	if err := rs.wait(ctx); err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if got[f.name] != want[f.name] {
			t.Errorf("pulled %s differs", f.name)
		}
	}
	if pid, _ := strconv.Atoi(string(bytes.TrimSpace(rsOut.Bytes()))); pid != tg.PID() {
		t.Errorf("restore printed %q, want pid %d", rsOut.String(), tg.PID())
	}
	provenRestore(ctx, t, tg, before)

	// Extract: the producers' files come out as they went in.
	x := mkdir(t, filepath.Join(dir, "x"))
	if out, err := exec.CommandContext(ctx, bin, "--images-dir", x, "extract", "--from", archive).CombinedOutput(); err != nil {
		t.Fatalf("extract: %v: %s", err, out)
	}
	for _, f := range files {
		if d := fileDigest(t, filepath.Join(x, f.name)); d != want[f.name] {
			t.Errorf("extracted %s differs", f.name)
		}
	}
	if _, err := os.Stat(filepath.Join(x, "inventory.img")); err != nil {
		t.Errorf("no inventory.img in the extract: %v", err)
	}
}

// TestProducerFailureKeepsProcess: a producer that fails halfway fails the
// checkpoint; CRIU resumes the target, which runs on intact.
func TestProducerFailureKeepsProcess(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, before := startedTarget(ctx, t, dir, 32)
	archive := filepath.Join(dir, "archive")
	work := mkdir(t, filepath.Join(dir, "w"))
	ck := startGCS(ctx, t, gcsOpts{}, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", archive,
		"--work-dir", work, "--producers", "1")
	images := filepath.Join(work, "img")
	waitForFile(ctx, t, filepath.Join(images, criusock.CaptureSocket))
	cl, err := criusock.DialProducer(ctx, images, "dumper")
	if err != nil {
		t.Fatal(err)
	}
	if err := cl.Push(ctx, "vram.bin", io.LimitReader(&rngReader{r: rand.New(rand.NewPCG(5, 5))}, 8<<20)); err != nil {
		t.Fatal(err)
	}
	cl.Abort()
	if err := ck.wait(ctx); err == nil {
		t.Fatal("checkpoint succeeded although its producer failed")
	} else {
		t.Logf("checkpoint failed as it should: %v", err)
	}
	if _, err := os.Stat(filepath.Join(archive, "manifest.json")); err == nil {
		t.Fatal("a failed checkpoint left a manifest")
	}
	after, err := tg.Prove(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := after.Check(before); err != nil {
		t.Fatal(err)
	}
}

// TestRestoreFailureKillsTree: serving fails after CRIU restored the tree
// (a producer that pulls aborts): the restore fails, says the restored tree
// was killed, and nothing of it runs on. (This target's child also exits
// on its own once its parent is gone; proc's tests prove that KillTree
// takes children that would not.)
func TestRestoreFailureKillsTree(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, _ := startedTarget(ctx, t, dir, 32)
	archive := filepath.Join(dir, "archive")
	if r := gcsRun(ctx, t, "checkpoint", "--pid", strconv.Itoa(tg.PID()), "--to", archive, "--work-dir", mkdir(t, filepath.Join(dir, "w"))); r.code != 0 {
		t.Fatalf("checkpoint: exit %d: %s", r.code, r.stderr)
	}
	if err := tg.WaitGone(ctx); err != nil {
		t.Fatal(err)
	}
	work := mkdir(t, filepath.Join(dir, "w2"))
	rs := startGCS(ctx, t, gcsOpts{}, "restore", "--from", archive, "--work-dir", work, "--producers", "1")
	// CRIU needs no producer: it restores the tree while serving waits, and
	// writes its pidfile as it exits.
	waitForFile(ctx, t, filepath.Join(work, "restored.pid"))
	waitRunning(ctx, t, tg.PID(), tg.ChildPID())
	time.Sleep(500 * time.Millisecond)
	cl, err := criusock.DialPull(ctx, filepath.Join(work, "img"), "failing")
	if err != nil {
		t.Fatal(err)
	}
	cl.Abort()
	if err := rs.wait(ctx); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("restore with a failing producer: %v, want the restored tree killed", err)
	}
	mustBeGone(ctx, t, tg)
}

// waitRunning waits until every pid runs, untraced (CRIU let go of it).
func waitRunning(ctx context.Context, t testing.TB, pids ...int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		up := 0
		for _, p := range pids {
			if _, err := os.Stat(fmt.Sprintf("/proc/%d", p)); err == nil && tracerPID(p) == 0 {
				up++
			}
		}
		if up == len(pids) {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("pids %v not running after a minute", pids)
		case <-time.After(20 * time.Millisecond):
		}
	}
}
