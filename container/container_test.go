package container

import (
	"archive/tar"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/swrk"
)

// TestRootfsTree: what podman diff names as added goes into
// rootfs-diff.tar with all it holds, a changed directory not (its changed
// entries are named themselves), a changed file yes; names are relative
// to the root, as podman's export writes them.
func TestRootfsTree(t *testing.T) {
	root := t.TempDir()
	for p, body := range map[string]string{"etc/hosts": "h", "etc/app/conf": "c", "tmp/new": "n", "bin/sh": "sh", "usr/lib/x": "x"} {
		if err := os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, p), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("conf", filepath.Join(root, "etc/app/link")); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "diff.tar")
	f, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	tw := tar.NewWriter(f)
	seen := map[string]bool{}
	for _, step := range []struct {
		path string
		all  bool
	}{{"/etc", true}, {"/tmp", false}, {"/tmp/new", false}, {"/bin/sh", false}, {"/etc/hosts", false}, {"/gone", false}} {
		if err := addTree(tw, root, step.path, step.all, seen); err != nil {
			t.Fatalf("%s: %v", step.path, err)
		}
	}
	tw.Close()
	f.Close()
	r, _ := os.Open(out)
	defer r.Close()
	rd := tar.NewReader(r)
	got := map[string]string{}
	for {
		h, err := rd.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(rd)
		got[h.Name] = string(b) + h.Linkname
	}
	want := map[string]string{"etc/": "", "etc/hosts": "h", "etc/app/": "", "etc/app/conf": "c", "etc/app/link": "conf", "tmp/new": "n", "bin/sh": "sh"}
	if len(got) != len(want) {
		t.Errorf("entries %v, want %v", got, want)
	}
	for name, body := range want {
		if got[name] != body {
			t.Errorf("%s: %q, want %q", name, got[name], body)
		}
	}
}

// TestPrepare: a launcher leaves swrk its settings and the container's
// info beside the socket; a restore reads the info back and refuses a
// checkpoint that holds none.
func TestPrepare(t *testing.T) {
	dir := t.TempDir()
	x := criusock.Launch{CRIU: "/opt/criu", ImagesDir: dir, Args: []string{"--action-script", "/x.sh"}}
	if err := prepare(x, Info{Runtime: "runc", ID: "web", Bundle: "/srv/web"}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dir, swrk.SettingsFile))
	if err != nil || !strings.Contains(string(b), `"criu":"/opt/criu"`) || !strings.Contains(string(b), `"/x.sh"`) {
		t.Fatalf("settings %s, %v", b, err)
	}
	info, err := readInfo(dir)
	if err != nil || info.ID != "web" || info.Bundle != "/srv/web" {
		t.Fatalf("info %+v, %v", info, err)
	}
	if _, err := readInfo(t.TempDir()); err == nil {
		t.Fatal("a checkpoint without container.json read as a container's")
	}
}

func TestOpenRefuses(t *testing.T) {
	for _, o := range []Options{{Runtime: "crun"}, {Runtime: "podman", Root: "/run/x"}, {Runtime: "podman", Bundle: "/b"}} {
		if _, err := open(o); !errors.Is(err, errdefs.ErrUsage) {
			t.Errorf("%+v: %v", o, err)
		}
	}
}

// The runtime runs gpucr-stream-swrk where it lies beside gpucr-stream,
// executable; anything else there leaves gpucr-stream itself.
func TestSwrkBeside(t *testing.T) {
	for _, c := range []struct {
		name   string
		beside func(path string) error // makes what lies at self+"-swrk"
		want   bool                    // swrkBeside picks it
	}{
		{"executable", func(p string) error { return os.WriteFile(p, nil, 0o755) }, true},
		{"none", func(string) error { return nil }, false},
		{"not executable", func(p string) error { return os.WriteFile(p, nil, 0o644) }, false},
		{"a directory", func(p string) error { return os.Mkdir(p, 0o755) }, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			self := filepath.Join(t.TempDir(), "gpucr-stream")
			if err := c.beside(self + "-swrk"); err != nil {
				t.Fatal(err)
			}
			want := self
			if c.want {
				want = self + "-swrk"
			}
			if got := swrkBeside(self); got != want {
				t.Errorf("swrkBeside = %s, want %s", got, want)
			}
		})
	}
}
