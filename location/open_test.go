package location

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/streamer"
)

// What a kind of location cannot be opened as is refused with the error
// kind the command's exit code depends on.
func TestOpenRefusals(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "ckpt.stream")
	if err := os.WriteFile(file, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	parse := func(s string) Location {
		l, err := Parse(s)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	store := func(s string) error { _, _, err := OpenStore(ctx, parse(s), Config{}); return err }
	tests := []struct {
		name string
		err  error
		want error
	}{
		{"store of a stream file", store(file), errdefs.ErrUsage},
		{"store of stdio", store("-"), errdefs.ErrUsage},
		{"store of tcp", store("tcp://127.0.0.1:1"), errdefs.ErrUsage},
		{"store of a missing dir", store(filepath.Join(dir, "none")), errdefs.ErrNotFound},
		{"output to a stream file", func() error { _, err := OpenOutput(ctx, parse(file), Config{}); return err }(), errdefs.ErrUsage},
		{"source of a missing archive", func() error {
			_, err := OpenSource(ctx, parse(filepath.Join(dir, "none")), Config{BufferLimit: 1 << 20}, source.StreamSourceOptions{})
			return err
		}(), errdefs.ErrNotFound},
		{"manifest of tcp", func() error { _, _, err := ReadManifest(ctx, parse("tcp://127.0.0.1:1"), Config{}); return err }(), errdefs.ErrUsage},
	}
	for _, tc := range tests {
		if !errors.Is(tc.err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, tc.err, tc.want)
		}
	}
	// A file is a store's directory only if it is one.
	if _, _, err := OpenStore(ctx, Location{Kind: Archive, Path: file, Raw: file}, Config{}); !errors.Is(err, errdefs.ErrUsage) {
		t.Errorf("store of a file as an archive: %v", err)
	}
}

// fakeOutput records what a location.Output passes on to it.
type fakeOutput struct {
	streamer.Output // nil: only WriteFrame is called
	frames          int
	err             error
}

func (f *fakeOutput) WriteFrame(context.Context, *manifest.FrameHeader, []byte) (streamer.FramePos, error) {
	f.frames++
	return streamer.FramePos{Pos: 7}, f.err
}

type fakeAsync struct {
	fakeOutput
	async int
}

func (f *fakeAsync) WriteFrameAsync(_ context.Context, _ *manifest.FrameHeader, _ []byte, done func(error)) (streamer.FramePos, error) {
	f.async++
	return streamer.FramePos{Pos: 9}, nil // done is the archive's to call, later
}

// An Output passes payload writes on to an archive that writes them on
// its own goroutines, and writes any other output's frames at once.
func TestOutputWriteFrameAsync(t *testing.T) {
	var _ streamer.AsyncOutput = (*Output)(nil)
	boom := errors.New("boom")
	async := &fakeAsync{}
	for _, tc := range []struct {
		name     string
		inner    streamer.Output
		wantPos  int64
		wantDone int
		wantErr  error
	}{
		{"archive", async, 9, 0, nil},
		{"stream", &fakeOutput{}, 7, 1, nil},
		{"stream fails", &fakeOutput{err: boom}, 7, 0, boom},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := &Output{Output: tc.inner}
			dones := 0
			loc, err := o.WriteFrameAsync(context.Background(), &manifest.FrameHeader{Type: manifest.FrameData}, []byte("x"), func(err error) {
				if err != nil {
					t.Errorf("done(%v)", err)
				}
				dones++
			})
			if !errors.Is(err, tc.wantErr) || loc.Pos != tc.wantPos || dones != tc.wantDone {
				t.Fatalf("WriteFrameAsync = %+v, %v with done called %d times; want pos %d, %v, %d", loc, err, dones, tc.wantPos, tc.wantErr, tc.wantDone)
			}
		})
	}
	if async.async != 1 || async.frames != 0 {
		t.Fatalf("the archive got %d payload writes and %d frames, want 1 and 0", async.async, async.frames)
	}
}

// TestArchiveOf: an archive wrapped by OpenSource's own closeWith is
// still found as one (ArchiveOf, for its counters and ranges) and still
// yields its manifest (source.ManifestOf); a stream so wrapped is neither.
func TestArchiveOf(t *testing.T) {
	ctx := context.Background()
	store := mem.New("archiveof")
	out, err := streamer.NewArchiveOutput(ctx, store, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.WriteFile("inventory.img", strings.NewReader("inv"), false); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		t.Fatal(err)
	}
	a, err := source.OpenArchive(ctx, store, pipeline.Options{})
	if err != nil {
		t.Fatal(err)
	}
	wrapped := closeWith{a, io.NopCloser(nil)}
	defer wrapped.Close()
	if got := ArchiveOf(wrapped); got != a {
		t.Errorf("ArchiveOf(closeWith{archive}) = %p, want %p", got, a)
	}
	if m := source.ManifestOf(wrapped); m != a.Manifest() {
		t.Errorf("ManifestOf(closeWith{archive}) = %p, want %p", m, a.Manifest())
	}
	stream := closeWith{source.NewStreamSource(ctx, []io.Reader{strings.NewReader("")}, []string{"empty"}, source.StreamSourceOptions{}), io.NopCloser(nil)}
	defer stream.Close()
	if ArchiveOf(stream) != nil || source.ManifestOf(stream) != nil {
		t.Errorf("a wrapped stream is taken for an archive")
	}
}
