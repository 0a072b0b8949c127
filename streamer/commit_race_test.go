package streamer

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/testwait"
)

// Two captures into one location, both past the check at the start: the
// first to commit wins; the other fails with ErrExists, saying so, and
// removes its own segments, never the winner's (both used to commit, the
// second manifest replacing the first over segments both had written).
func TestArchiveLosesCommitRace(t *testing.T) {
	for _, kind := range []string{"mem", "dir"} {
		t.Run(kind, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
			defer cancel()
			var st store.Store = mem.New("race")
			if kind == "dir" {
				st = dir.New(t.TempDir())
			}
			var caps [2]*Capture
			for i := range caps {
				out, err := NewArchiveOutput(ctx, st, 1<<20)
				if err != nil {
					t.Fatal(err)
				}
				if caps[i], err = NewCapture(ctx, out, pipeline.Options{ChunkSize: 128 << 10, Workers: 2, Codec: pipelinetest.MustSpec(t, "none")}); err != nil {
					t.Fatal(err)
				}
				if _, err := caps[i].WriteFile("pages-1.img", &patternReader{n: 3 << 20}, false); err != nil {
					t.Fatal(err)
				}
			}
			won, err := caps[0].Close(ctx, manifest.Manifest{ID: "first"})
			if err != nil {
				t.Fatal(err)
			}
			_, err = caps[1].Close(ctx, manifest.Manifest{ID: "second"})
			if !errors.Is(err, errdefs.ErrExists) || !strings.Contains(err.Error(), "committed at "+st.String()+" by another capture meanwhile") {
				t.Fatalf("losing capture: %v, want ErrExists saying another capture committed", err)
			}
			want := []string{manifest.ManifestName}
			for _, s := range won.Segments {
				want = append(want, s.Name)
			}
			slices.Sort(want)
			objs, err := st.List(ctx, "")
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, o := range objs {
				got = append(got, o.Name)
			}
			if !slices.Equal(got, want) {
				t.Fatalf("store holds %v, want the winner's %v", got, want)
			}
			m, err := source.ReadManifest(ctx, st)
			if err != nil || m.ID != "first" {
				t.Fatalf("manifest %+v, %v; want the winner's", m, err)
			}
		})
	}
}
