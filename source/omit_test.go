package source

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/testwait"
	"golang.org/x/sys/unix"
)

// cut is b without the spans.
func cut(b []byte, spans []Span) []byte {
	var out []byte
	var at int64
	for _, s := range spans {
		out = append(out, b[at:s.Off]...)
		at = s.End()
	}
	return append(out, b[at:]...)
}

func TestOmitWrite(t *testing.T) {
	data := pipelinetest.SmallData(10000, 5)
	for _, tc := range []struct {
		name   string
		spans  []Span
		writes []int // the sizes data is written in
	}{
		{"none", nil, []int{10000}},
		{"one span inside one write", []Span{{100, 200}}, []int{10000}},
		{"span across writes", []Span{{900, 300}}, []int{1000, 1000, 8000}},
		{"span covering whole writes", []Span{{1000, 3000}}, []int{1000, 1000, 1000, 1000, 6000}},
		{"at the start and the end", []Span{{0, 10}, {9990, 10}}, []int{5, 5, 9980, 10}},
		{"many spans in one write", []Span{{1, 1}, {3, 1}, {5, 4000}, {5000, 1}}, []int{10000}},
		{"empty writes", []Span{{50, 50}}, []int{0, 60, 0, 9940}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			o, err := NewOmit(&buf, tc.spans)
			if err != nil {
				t.Fatal(err)
			}
			at := 0
			for _, n := range tc.writes {
				if k, err := o.Write(data[at : at+n]); k != n || err != nil {
					t.Fatalf("Write(%d bytes) = %d, %v", n, k, err)
				}
				at += n
			}
			if want := cut(data, tc.spans); !bytes.Equal(buf.Bytes(), want) {
				t.Fatalf("wrote %d bytes, want %d (or different ones)", buf.Len(), len(want))
			}
			if o.Written() != int64(len(data)) {
				t.Fatalf("Written() = %d, want %d", o.Written(), len(data))
			}
		})
	}
	for _, bad := range [][]Span{{{10, 0}}, {{10, 5}, {12, 5}}, {{20, 5}, {10, 5}}, {{-1, 5}}} {
		if _, err := NewOmit(io.Discard, bad); err == nil {
			t.Errorf("NewOmit(%v) accepted spans that are not sorted, disjoint and non-empty", bad)
		}
	}
}

// Copy into an Omit leaves the spans out of what every source writes, by
// vmsplice into a pipe or by Write, whether a span is a whole zero chunk
// (skipped without a byte spliced), part of one, or crosses chunks.
func TestCopyOmit(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(2*time.Minute))
	defer cancel()
	const chunk = minSpliceChunk
	pages := splicePages(11)
	files := map[string][]byte{"pages-1.img": pages}
	spanSets := [][]Span{
		{{2 * chunk, chunk}}, // the zero chunk
		{{4096, 8192}, {2*chunk + 4096, chunk - 8192}, {4*chunk - 100, 200}, {5 * chunk, 1000}},
		{{0, int64(len(pages))}},
	}
	sources := map[string]func(t *testing.T, spec string, limit int64) Source{
		"archive": func(t *testing.T, spec string, _ int64) Source {
			st := mem.New("omit")
			out, err := streamer.NewArchiveOutput(ctx, st, 150<<10)
			if err != nil {
				t.Fatal(err)
			}
			captureFiles(t, ctx, out, pipeline.Options{ChunkSize: chunk, Workers: 2, Codec: pipelinetest.MustSpec(t, spec)}, files)
			a, err := OpenArchive(ctx, st, pipeline.Options{Workers: 2})
			if err != nil {
				t.Fatal(err)
			}
			return a
		},
		"stream": func(t *testing.T, spec string, limit int64) Source {
			var buf bytes.Buffer
			out, err := streamer.NewStreamOutput([]io.Writer{&buf})
			if err != nil {
				t.Fatal(err)
			}
			captureFiles(t, ctx, out, pipeline.Options{ChunkSize: chunk, Workers: 2, Codec: pipelinetest.MustSpec(t, spec)}, files)
			s := NewStreamSource(ctx, []io.Reader{&buf}, []string{"buf"}, StreamSourceOptions{Options: pipeline.Options{Workers: 2, MemoryLimit: limit}})
			if err := s.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			return s
		},
	}
	for kind, open := range sources {
		for _, tc := range []struct {
			spec  string
			limit int64
		}{{"none", 1 << 30}, {"lz4", 1 << 30}, {"auto", 2 * chunk}} {
			t.Run(fmt.Sprintf("%s-%s-limit%d", kind, tc.spec, tc.limit), func(t *testing.T) {
				src := open(t, tc.spec, tc.limit)
				defer src.Close()
				for i, spans := range spanSets {
					want := cut(pages, spans)
					got, err := copyOmittingThroughPipe(ctx, src, "pages-1.img", i%2 == 1, -1, spans)
					if err != nil || !bytes.Equal(got, want) {
						t.Fatalf("spans %v into a pipe: %d bytes, want %d (equal %v), %v", spans, len(got), len(want), bytes.Equal(got, want), err)
					}
					var buf bytes.Buffer
					o, _ := NewOmit(&buf, spans)
					if n, err := src.Copy(ctx, "pages-1.img", o); err != nil || n != int64(len(pages)) || !bytes.Equal(buf.Bytes(), want) {
						t.Fatalf("spans %v into a buffer: Copy = %d, %v; %d bytes, want %d", spans, n, err, buf.Len(), len(want))
					}
				}
			})
		}
	}
}

// TestStreamCopyToFile: a stream source writes a file through a mapping,
// chunks held in memory, spilled (a memory limit of two chunks) and zero
// alike, the same bytes as Copy, the zero chunk a hole.
func TestStreamCopyToFile(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	const chunk = minSpliceChunk
	pages := splicePages(12)
	for _, tc := range []struct {
		spec  string
		limit int64
	}{{"none", 1 << 30}, {"lz4", 1 << 30}, {"auto", 2 * chunk}} {
		t.Run(fmt.Sprintf("%s-limit%d", tc.spec, tc.limit), func(t *testing.T) {
			var buf bytes.Buffer
			out, err := streamer.NewStreamOutput([]io.Writer{&buf})
			if err != nil {
				t.Fatal(err)
			}
			captureFiles(t, ctx, out, pipeline.Options{ChunkSize: chunk, Workers: 2, Codec: pipelinetest.MustSpec(t, tc.spec)},
				map[string][]byte{"pages-1.img": pages, "empty.img": nil})
			s := NewStreamSource(ctx, []io.Reader{&buf}, []string{"buf"}, StreamSourceOptions{Options: pipeline.Options{Workers: 2, MemoryLimit: tc.limit}})
			defer s.Close()
			if err := s.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			var fc FileCopier = s
			for name, want := range map[string][]byte{"pages-1.img": pages, "empty.img": nil} {
				f, err := os.Create(filepath.Join(t.TempDir(), name))
				if err != nil {
					t.Fatal(err)
				}
				n, err := fc.CopyToFile(ctx, name, f)
				if err != nil || n != int64(len(want)) {
					t.Fatalf("%s: CopyToFile = %d, %v; want %d bytes", name, n, err, len(want))
				}
				got, err := os.ReadFile(f.Name())
				if err != nil || !bytes.Equal(got, want) {
					t.Fatalf("%s: %d bytes read back, want %d (equal %v), %v", name, len(got), len(want), bytes.Equal(got, want), err)
				}
				var st unix.Stat_t
				if err := unix.Fstat(int(f.Fd()), &st); err != nil {
					t.Fatal(err)
				}
				if name == "pages-1.img" && st.Blocks*512 > int64(len(pages))-chunk/2 {
					t.Errorf("%s: %d bytes allocated for %d, a zero chunk of %d among them: no hole", name, st.Blocks*512, len(pages), chunk)
				}
				f.Close()
			}
		})
	}
}
