package criusock

import (
	"bytes"
	"context"
	"io"
	"slices"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/streamer"
)

// TestDecoratedArchiveManifest: an archive's manifest is found behind
// each of the decorators a restore puts around its source, and behind all
// of them at once: CarriedIn, which asked for a *source.ArchiveSource and
// found nothing behind one, lists the carried file. A stream behind them
// has no manifest.
func TestDecoratedArchiveManifest(t *testing.T) {
	ctx := context.Background()
	store := mem.New("decorated")
	out, err := streamer.NewArchiveOutput(ctx, store, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	c, err := streamer.NewCapture(ctx, out, pipeline.Options{Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.WriteCarried("descriptors.json", strings.NewReader(`["/dev/null"]`)); err != nil {
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
	defer a.Close()
	logf := func(s string) { t.Log(s) }
	decorators := []struct {
		name string
		wrap func(source.Source) source.Source
	}{
		{"ClearTimeWait", func(s source.Source) source.Source { return ClearTimeWait(s, logf) }},
		{"sparse", func(s source.Source) source.Source { return newSparse(s, logf) }},
		{"RemapTCPListenLater", func(s source.Source) source.Source { return RemapTCPListenLater(s, map[uint16]uint16{80: 8080}) }},
		{"waitFreePIDs", func(s source.Source) source.Source { return waitFreePIDs(s, 0, logf) }},
	}
	want := []string{"descriptors.json"}
	var all source.Source = a
	for _, d := range decorators {
		if got := CarriedIn(d.wrap(a)); !slices.Equal(got, want) {
			t.Errorf("CarriedIn(%s(archive)) = %q, want %q", d.name, got, want)
		}
		all = d.wrap(all)
	}
	if got := CarriedIn(all); !slices.Equal(got, want) {
		t.Errorf("CarriedIn(archive behind every decorator) = %q, want %q", got, want)
	}
	if m := source.ManifestOf(all); m != a.Manifest() {
		t.Errorf("ManifestOf(archive behind every decorator) = %p, want the archive's %p", m, a.Manifest())
	}

	var empty bytes.Buffer
	stream := source.NewStreamSource(ctx, []io.Reader{&empty}, []string{"empty"}, source.StreamSourceOptions{})
	defer stream.Close()
	all = stream
	for _, d := range decorators {
		all = d.wrap(all)
	}
	if m := source.ManifestOf(all); m != nil {
		t.Errorf("ManifestOf(stream behind every decorator) = %v, want nil", m)
	}
}
