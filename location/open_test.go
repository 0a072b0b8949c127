package location

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
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
			_, err := OpenSource(ctx, parse(filepath.Join(dir, "none")), Config{HoldLimit: 1 << 20}, streamer.StreamOptions{})
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
