package streamer

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/testwait"
)

// failingCommitStore is a store whose manifest commit fails: after the
// store took it (landed, the answer lost) or not; and whose reads fail
// from then on where down is set (the server gone again).
type failingCommitStore struct {
	store.Store
	landed, down bool
	failed       bool // the manifest's commit has failed
}

var errLostAnswer = errors.New("read: connection reset by peer")

func (s *failingCommitStore) Create(ctx context.Context, name string) (store.ObjectWriter, error) {
	w, err := s.Store.Create(ctx, name)
	if err != nil || name != manifest.ManifestName {
		return w, err
	}
	return &failingCommitWriter{ObjectWriter: w, s: s}, nil
}

func (s *failingCommitStore) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
	if s.failed && s.down {
		return nil, errors.New("dial tcp: connect: connection refused")
	}
	return s.Store.Open(ctx, name, off, length)
}

type failingCommitWriter struct {
	store.ObjectWriter
	s *failingCommitStore
}

func (w *failingCommitWriter) CommitNew(ctx context.Context) error {
	w.s.failed = true
	if w.s.landed {
		if err := w.ObjectWriter.CommitNew(ctx); err != nil {
			return err
		}
	}
	return errLostAnswer
}

// A manifest commit that fails but may have landed never leaves a
// manifest over removed segments: where the manifest is there, byte for
// byte the capture's, the commit succeeded; where the store cannot be
// asked, the segments stay (the torture run found a complete manifest
// whose segments the capture's Abort had removed); only where no manifest
// is there are they removed.
func TestArchiveCommitAnswerLost(t *testing.T) {
	for _, c := range []struct {
		name         string
		landed, down bool
		wantErr      bool // Close fails
		wantSegments bool // the segments are still there
	}{
		{"landed, the store answers", true, false, false, true},
		{"landed, the store down", true, true, true, true},
		{"not landed, the store down", false, true, true, true},
		{"not landed, the store answers", false, false, true, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
			defer cancel()
			inner := mem.New("lost")
			st := &failingCommitStore{Store: inner, landed: c.landed, down: c.down}
			out, err := NewArchiveOutput(ctx, st, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			cp, err := NewCapture(ctx, out, pipeline.Options{ChunkSize: 128 << 10, Workers: 2, Codec: pipelinetest.MustSpec(t, "none")})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := cp.WriteFile("pages-1.img", &patternReader{n: 3 << 20}, false); err != nil {
				t.Fatal(err)
			}
			_, err = cp.Close(ctx, manifest.Manifest{ID: "lost"})
			if (err != nil) != c.wantErr {
				t.Fatalf("Close: %v, want an error: %v", err, c.wantErr)
			}
			if err != nil && c.down && !strings.Contains(err.Error(), "segments are left in place") {
				t.Errorf("Close: %v, want it to say the segments are left", err)
			}
			segs, err := inner.List(ctx, manifest.SegmentPrefix)
			if err != nil {
				t.Fatal(err)
			}
			if (len(segs) > 0) != c.wantSegments {
				t.Fatalf("%d segments left, want some: %v", len(segs), c.wantSegments)
			}
			if !c.landed {
				return
			}
			// The manifest is there: every segment it names is too, and the
			// checkpoint reads back.
			m, err := source.ReadManifest(ctx, inner)
			if err != nil || m.ID != "lost" {
				t.Fatalf("manifest %+v, %v", m, err)
			}
			for _, s := range m.Segments {
				if _, err := inner.Stat(ctx, s.Name); err != nil {
					t.Errorf("segment %s the manifest names: %v", s.Name, err)
				}
			}
		})
	}
}
