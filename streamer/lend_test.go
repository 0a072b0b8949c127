package streamer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/testwait"
)

// roLender lends read-only mapped memory, so that a write into a lent
// chunk faults, and counts how it was read.
type roLender struct {
	data         []byte
	off          int
	lends, reads int
}

func newROLender(t *testing.T, b []byte) *roLender {
	m, err := unix.Mmap(-1, 0, len(b), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	copy(m, b)
	if err := unix.Mprotect(m, unix.PROT_READ); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(m) })
	return &roLender{data: m}
}

func (l *roLender) Lend(n int) ([]byte, error) {
	l.lends++
	return l.next(n)
}

func (l *roLender) Read(p []byte) (int, error) {
	l.reads++
	b, err := l.next(len(p))
	return copy(p, b), err
}

func (l *roLender) next(n int) ([]byte, error) {
	if l.off >= len(l.data) {
		return nil, io.EOF
	}
	b := l.data[l.off:min(l.off+n, len(l.data))]
	l.off += len(b)
	return b, nil
}

// scribble overwrites the lent memory: what the capture still referenced
// after the write returned would reach the archive damaged.
func (l *roLender) scribble(t *testing.T) {
	if err := unix.Mprotect(l.data, unix.PROT_READ|unix.PROT_WRITE); err != nil {
		t.Fatal(err)
	}
	for i := len(l.data) - 1; i >= 0; i-- { // the last chunks first: the last written
		l.data[i] = 0xa5
	}
}

// A file from a Lender is written from the lender's memory (never written
// to: it is read-only here) unless sealed, and reads back intact even
// though that memory is overwritten as soon as the write returns, through
// the archive's lanes, which write after the capture has let go of the
// chunk: the write returns only once nothing lent is referenced.
func TestCaptureLent(t *testing.T) {
	k := pipelinetest.Key(t, 3)
	for _, tc := range []struct {
		spec   string
		sealed bool
		lanes  int
	}{
		{"none", false, 3},
		{"none", false, 1},
		{"lz4", false, 2},
		{"none", true, 2},
	} {
		t.Run(fmt.Sprintf("%s/sealed=%v/lanes=%d", tc.spec, tc.sealed, tc.lanes), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
			defer cancel()
			base := pipelinetest.CountGoroutines()
			var seal *crypt.Session
			if tc.sealed {
				seal = pipelinetest.Session(t, k)
			}
			st := mem.New(t.Name())
			// Slow segment writes: the lanes lag behind the capture.
			st.FailWrite = func(string, int64) error { time.Sleep(200 * time.Microsecond); return nil }
			out, err := NewArchiveOutputAs(ctx, st, 1<<20, pipeline.Format{Seal: seal})
			if err != nil {
				t.Fatal(err)
			}
			out.SetLanes(tc.lanes)
			c, err := NewCapture(ctx, out, pipeline.Options{ChunkSize: 128 << 10, Workers: 2, Codec: pipelinetest.MustSpec(t, tc.spec)})
			if err != nil {
				t.Fatal(err)
			}
			// Mixed data has zero chunks, and a tail shorter than a chunk.
			data := pipelinetest.MixedData(6<<20+12345, 9)
			l := newROLender(t, data)
			n, err := c.WriteBackground("vram-1-00.bin", l)
			if err != nil || n != int64(len(data)) {
				t.Fatalf("WriteBackground = %d, %v; want %d", n, err, len(data))
			}
			l.scribble(t)
			if tc.sealed != (l.lends == 0) || (l.lends == 0) == (l.reads == 0) {
				t.Fatalf("sealed %v: %d lends, %d reads", tc.sealed, l.lends, l.reads)
			}
			if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
				t.Fatal(err)
			}
			ro := pipeline.Options{Workers: 2}
			if tc.sealed {
				ro.Key = k
			}
			src, err := source.OpenArchive(ctx, st, ro)
			if err != nil {
				t.Fatal(err)
			}
			pipelinetest.CheckSource(t, ctx, "archive", src, map[string][]byte{"vram-1-00.bin": data})
			pipelinetest.WaitGoroutines(t, base)
		})
	}
}

// A lent file whose segment write fails returns the failure, once nothing
// lent is referenced, and the capture commits nothing.
func TestCaptureLentFails(t *testing.T) {
	ctx := context.Background()
	base := pipelinetest.CountGoroutines()
	st := mem.New(t.Name())
	st.FailWrite = func(name string, written int64) error {
		if strings.HasPrefix(name, manifest.SegmentPrefix) && written > 512<<10 {
			return errBoom
		}
		return nil
	}
	out, err := NewArchiveOutput(ctx, st, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	out.SetLanes(2)
	c, _ := NewCapture(ctx, out, pipeline.Options{ChunkSize: 128 << 10, Workers: 2, Codec: pipelinetest.MustSpec(t, "none")})
	l := newROLender(t, pipelinetest.SmallData(8<<20, 4))
	_, werr := c.WriteBackground("vram-1-00.bin", l)
	l.scribble(t)
	if _, cerr := c.Close(ctx, manifest.Manifest{}); !errors.Is(cerr, errBoom) {
		t.Fatalf("Close = %v (WriteBackground: %v)", cerr, werr)
	}
	if werr != nil && !errors.Is(werr, errBoom) {
		t.Fatalf("WriteBackground = %v", werr)
	}
	if names := st.Names(); len(names) != 0 {
		t.Fatalf("store keeps %v after a failed capture", names)
	}
	pipelinetest.WaitGoroutines(t, base)
}

// BenchmarkCaptureKept is BenchmarkCaptureBackground's capture with the
// store's VRAM files in GPUCR_BENCH_DIR (a tmpfs: the kept copy), read into
// chunk buffers (as before) or mapped and lent (vram's keptMap).
//
//	GPUCR_BENCH_DIR=/dev/shm GPUCR_BENCH_MIB=8192 go test -run X -bench CaptureKept -benchtime 3x ./streamer/
func BenchmarkCaptureKept(b *testing.B) {
	total := pipelinetest.BenchMiB("GPUCR_BENCH_MIB", 1024)
	per := total / benchStoreFiles
	base := os.Getenv("GPUCR_BENCH_DIR")
	if base == "" {
		base = b.TempDir()
	}
	kept, err := os.MkdirTemp(base, "gpucr-kept-")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(kept)
	tmpl := pipelinetest.BenchTemplate()
	for i := range benchStoreFiles {
		f, err := os.Create(filepath.Join(kept, fmt.Sprint(i)))
		if err == nil {
			_, err = io.Copy(f, &pipelinetest.RepeatReader{Tmpl: tmpl, Off: int64(i) * per, N: per})
			err = errors.Join(err, f.Close())
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	for _, mode := range []string{"read", "lend"} {
		b.Run("store="+mode, func(b *testing.B) {
			benchStoreBeside(b, total, func(c *Capture, i int) error {
				f, err := os.Open(filepath.Join(kept, fmt.Sprint(i)))
				if err != nil {
					return err
				}
				defer f.Close()
				var r io.Reader = f
				if mode == "lend" {
					m, err := unix.Mmap(int(f.Fd()), 0, int(per), unix.PROT_READ, unix.MAP_SHARED)
					if err != nil {
						return err
					}
					defer unix.Munmap(m)
					r = &roLender{data: m}
				}
				_, err = c.WriteBackground(fmt.Sprintf("vram-1-%d.bin", i), r)
				return err
			})
		})
	}
}
