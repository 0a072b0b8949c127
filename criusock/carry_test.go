package criusock

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/testwait"
)

// TestCarry: files the caller put into the images dir before CRIU
// connects (runc's descriptors.json) and during the dump (a --carry file
// written before post-dump; an absolute path) ride in the checkpoint
// flagged carried, the first ahead of CRIU's images; a restore writes
// them back into its images dir. A symlink planted under a carried name
// is not followed.
func TestCarry(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	dir, other := shortDir(t), t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "descriptors.json"), []byte(`["/dev/null"]`), 0o600); err != nil {
		t.Fatal(err)
	}
	abs := filepath.Join(other, "engine.conf")
	if err := os.WriteFile(abs, []byte("engine"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, stream := newCapture(t, ctx)
	in, err := StartIntakeWith(ctx, dir, c, IntakeOptions{Carry: []string{"late.json", abs}})
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
	// Written during the dump, before CRIU's last image, whole at once (a
	// rename), as a caller must: a file is carried as it is when taken.
	if err := os.WriteFile(filepath.Join(dir, ".late.tmp"), []byte("late"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, ".late.tmp"), filepath.Join(dir, "late.json")); err != nil {
		t.Fatal(err)
	}
	if err := criu.Push(ctx, "inventory.img", strings.NewReader("inv")); err != nil {
		t.Fatal(err)
	}
	if _, err := in.Drained(ctx); err != nil { // post-dump
		t.Fatal(err)
	}
	criu.Close()
	if _, err := in.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Close(ctx, manifest.Manifest{}); err != nil {
		t.Fatal(err)
	}
	src := source.NewStreamSource(ctx, []io.Reader{stream}, []string{"stream"}, source.StreamSourceOptions{})
	defer src.Close()
	files, err := src.Files(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	carried := map[string]bool{}
	for _, f := range files {
		order = append(order, f.Name)
		carried[f.Name] = f.Carried
	}
	if order[0] != "descriptors.json" {
		t.Errorf("order %q: descriptors.json, there when CRIU connected, should come first", order)
	}
	for name, want := range map[string]bool{"descriptors.json": true, "late.json": true, "engine.conf": true, "pages-1.img": false, "inventory.img": false} {
		if got, ok := carried[name]; !ok || got != want {
			t.Errorf("%s: listed %v, carried %v; want carried %v", name, ok, got, want)
		}
	}
	names, err := CarriedFiles(ctx, src)
	if err != nil {
		t.Fatal(err)
	}
	back := t.TempDir()
	if err := WriteCarried(ctx, src, back, names); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{"descriptors.json": `["/dev/null"]`, "late.json": "late", "engine.conf": "engine"} {
		if b, err := os.ReadFile(filepath.Join(back, name)); err != nil || string(b) != want {
			t.Errorf("%s written back: %q, %v", name, b, err)
		}
	}
	if err := WriteCarried(ctx, src, back, []string{"missing.json"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("a carried file the checkpoint lacks: %v", err)
	}
}

// TestCarryMissing: a file named with --carry that is not there by the
// end of the dump fails it; a symlink under that name is not followed.
func TestCarryMissing(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Scale(time.Minute))
	defer cancel()
	for _, planted := range []bool{false, true} {
		dir := shortDir(t)
		if planted {
			if err := os.Symlink("/etc/hostname", filepath.Join(dir, "wanted.json")); err != nil {
				t.Fatal(err)
			}
		}
		c, _ := newCapture(t, ctx)
		in, err := StartIntakeWith(ctx, dir, c, IntakeOptions{Carry: []string{"wanted.json"}})
		if err != nil {
			t.Fatal(err)
		}
		criu, err := Dial(ctx, dir)
		if err != nil {
			t.Fatal(err)
		}
		if err := criu.Push(ctx, "inventory.img", strings.NewReader("inv")); err != nil && !planted {
			t.Fatal(err)
		}
		_, err = in.Drained(ctx)
		criu.Close()
		in.Wait(ctx)
		c.Abort(errors.New("test over"))
		c.Close(ctx, manifest.Manifest{})
		if err == nil || !strings.Contains(err.Error(), "wanted.json") {
			t.Errorf("planted symlink %v: the dump went on without wanted.json: %v", planted, err)
		}
	}
}

func TestCheckCarry(t *testing.T) {
	for p, ok := range map[string]bool{"descriptors.json": true, "/etc/app/x.conf": true, "sub/x": false, "pages-1.img": false,
		"/a/inventory.img": false, "streamer-serve.sock": false, "": false, "..": false} {
		if err := CheckCarry([]string{p}); (err == nil) != ok {
			t.Errorf("CheckCarry(%q) = %v", p, err)
		}
	}
}
