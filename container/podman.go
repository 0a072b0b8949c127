package container

// Podman (whose OCI runtime is runc): `podman container checkpoint` and
// `restore` with --runtime-flag criu=gpucr-stream. Podman's images dir is
// its container's userdata/checkpoint, where a symlink named as the
// streamer socket points at the capture or serve listening in this
// process's images dir (swrk reads the settings beside the socket's
// target). Podman's metadata rides in the checkpoint as carried files:
// config.dump and spec.dump (written by podman before it runs runc, when
// it exports), runc's descriptors.json, and the container's root file
// system changes (rootfs-diff.tar, deleted.files; podman_rootfs.go),
// made here at CRIU's post-dump while the container is frozen. A
// restore as the same container (it still exists, checkpointed) puts
// descriptors.json and inventory.img into its userdata/checkpoint; one as
// a new container imports an archive of podman's layout (checkpointctl's)
// holding the metadata and the symlink, not the images, which stream.

import (
	"archive/tar"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/errdefs"
)

type podman struct{ o Options }

// podmanInspect is what is read of `podman container inspect`.
type podmanInspect struct {
	ID    string `json:"Id"`
	Name  string `json:"Name"`
	State struct {
		Status       string `json:"Status"`
		PID          int    `json:"Pid"`
		Checkpointed bool   `json:"Checkpointed"`
	} `json:"State"`
	StaticDir   string `json:"StaticDir"`
	GraphDriver struct {
		Data struct {
			MergedDir string `json:"MergedDir"`
		} `json:"Data"`
	} `json:"GraphDriver"`
	ImageName string `json:"ImageName"`
}

// Podman's metadata files (checkpointctl's lib/metadata.go names them).
const (
	configDump   = "config.dump"
	specDump     = "spec.dump"
	rootfsDiff   = "rootfs-diff.tar"
	deletedFiles = "deleted.files"
	descriptors  = "descriptors.json"
)

// podmanCarried are the files a restore needs of a Podman checkpoint; the
// root file system changes are there when the container had any (always
// in one taken here, only then in one podman exported).
var podmanCarried = []string{descriptors, InfoFile, configDump, specDump}

func (p *podman) inspect(ctx context.Context, id string) (podmanInspect, error) {
	var in []podmanInspect
	out, _, err := command(ctx, "", p.o.Binary, "container", "inspect", id)
	if err != nil {
		if strings.Contains(err.Error(), "no such container") {
			return podmanInspect{}, fmt.Errorf("podman: no container %q: %w", id, errdefs.ErrNotFound)
		}
		return podmanInspect{}, err
	}
	if err := json.Unmarshal([]byte(out), &in); err != nil || len(in) != 1 {
		return podmanInspect{}, fmt.Errorf("podman container inspect %s: %d containers, %v", id, len(in), err)
	}
	return in[0], nil
}

func (p *podman) forCheckpoint(ctx context.Context, id string) (int, criusock.Launcher, error) {
	in, err := p.inspect(ctx, id)
	if err != nil {
		return 0, nil, err
	}
	if in.State.Status != "running" || in.State.PID <= 0 {
		return 0, nil, errdefs.Usagef("podman: container %q is %s, not running", id, in.State.Status)
	}
	if in.StaticDir == "" || in.GraphDriver.Data.MergedDir == "" {
		return 0, nil, fmt.Errorf("podman: container %q: inspect names no userdata or root file system (storage driver not overlay?)", id)
	}
	return in.State.PID, &podmanLauncher{p: p, c: in}, nil
}

func (p *podman) forRestore(ctx context.Context, name string) (criusock.Launcher, error) {
	in, err := p.inspect(ctx, name)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		return &podmanLauncher{p: p, name: name}, nil // a new container
	case err != nil:
		return nil, err
	case in.State.Status == "running" || in.State.Status == "paused":
		return nil, errdefs.Usagef("podman: container %q is %s: restore under another name", name, in.State.Status)
	}
	return &podmanLauncher{p: p, c: in, name: name}, nil // the same container, checkpointed
}

// podmanLauncher checkpoints container c, or restores as name (into c
// when it exists).
type podmanLauncher struct {
	p    *podman
	c    podmanInspect
	name string
}

// Carried: on dump, where podman and runc leave them (Dump writes the
// others into the images dir); on restore, by name.
func (l *podmanLauncher) Carried() []string {
	if l.name != "" {
		return podmanCarried
	}
	u := l.c.StaticDir
	return []string{filepath.Join(u, "checkpoint", descriptors), InfoFile, filepath.Join(u, configDump), filepath.Join(u, specDump), rootfsDiff, deletedFiles}
}

// linkSocket makes podman's images dir (created) point at the streamer
// socket listening in images; the returned func removes the link.
func linkSocket(podmanImages, images, sock string) (func(), error) {
	images, err := filepath.Abs(images)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(podmanImages, 0o700); err != nil {
		return nil, err
	}
	link := filepath.Join(podmanImages, sock)
	os.Remove(link)
	if err := os.Symlink(filepath.Join(images, sock), link); err != nil {
		return nil, err
	}
	return func() { os.Remove(link) }, nil
}

func (l *podmanLauncher) Dump(ctx context.Context, x criusock.Launch) (criusock.Launched, error) {
	res := criusock.Launched{Log: filepath.Join(l.c.StaticDir, "dump.log")}
	info := Info{Runtime: "podman", ID: l.c.ID, Name: strings.TrimPrefix(l.c.Name, "/"), Image: l.c.ImageName}
	if err := prepare(x, info); err != nil {
		return res, err
	}
	unlink, err := linkSocket(filepath.Join(l.c.StaticDir, "checkpoint"), x.ImagesDir, criusock.CaptureSocket)
	if err != nil {
		return res, err
	}
	defer unlink()
	// --export makes podman write config.dump and spec.dump before it runs
	// runc; the archive it writes afterwards is not needed.
	export := filepath.Join(x.WorkDir, "podman-export.tar")
	defer os.Remove(export)
	args := []string{"--runtime-flag", "criu=" + l.p.o.Self, "container", "checkpoint", "--export", export}
	if x.LeaveRunning {
		args = append(args, "--leave-running")
	}
	out, took, err := command(ctx, x.CRIU, l.p.o.Binary, append(args, l.c.ID)...)
	res.Output, res.Took = out, took
	return res, err
}

// PostDump writes the container's root file system changes into the
// images dir while CRIU holds it frozen: carried, they restore it as a
// new container.
func (l *podmanLauncher) PostDump(ctx context.Context, images string) error {
	return writeRootfsDiff(ctx, l.p.o.Binary, l.c.ID, l.c.GraphDriver.Data.MergedDir, images)
}

func (l *podmanLauncher) Restore(ctx context.Context, x criusock.Launch) (criusock.Launched, error) {
	res := criusock.Launched{}
	info, err := readInfo(x.ImagesDir)
	if err != nil {
		return res, err
	}
	if info.Runtime != "podman" {
		return res, errdefs.Usagef("podman restore: the checkpoint is of a %s container, not Podman's", info.Runtime)
	}
	if err := prepare(x, info); err != nil {
		return res, err
	}
	args := []string{"--runtime-flag", "criu=" + l.p.o.Self, "container", "restore"}
	if l.c.ID != "" {
		// The same container: podman restores from its own images dir.
		cdir := filepath.Join(l.c.StaticDir, "checkpoint")
		unlink, err := linkSocket(cdir, x.ImagesDir, criusock.ServeSocket)
		if err != nil {
			return res, err
		}
		defer unlink()
		err = copyInto(x.ImagesDir, cdir, descriptors)
		if err == nil {
			err = inventoryInto(ctx, x, cdir)
		}
		if err != nil {
			return res, err
		}
		args = append(args, l.c.ID)
		res.Log = filepath.Join(l.c.StaticDir, "restore.log")
	} else {
		archive := filepath.Join(x.WorkDir, "podman-import.tar")
		defer os.Remove(archive)
		if err := importArchive(ctx, x, archive); err != nil {
			return res, err
		}
		args = append(args, "--import", archive, "--name", l.name)
	}
	out, took, err := command(ctx, x.CRIU, l.p.o.Binary, args...)
	res.Output, res.Took = out, took
	if err != nil {
		return res, err
	}
	in, err := l.p.inspect(ctx, l.name)
	if err != nil || in.State.Status != "running" {
		return res, fmt.Errorf("podman restored %s, but it is not running (%s): %v", l.name, in.State.Status, err)
	}
	res.PID = in.State.PID
	return res, nil
}

// copyInto copies file name from one directory into another.
func copyInto(from, to, name string) error {
	b, err := os.ReadFile(filepath.Join(from, name))
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(to, name), b, 0o600)
}

// inventoryInto writes the checkpoint's inventory.img into dir: podman
// restores only where it finds one.
func inventoryInto(ctx context.Context, x criusock.Launch, dir string) error {
	f, err := os.OpenFile(filepath.Join(dir, "inventory.img"), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = x.Src.Copy(ctx, "inventory.img", f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// importArchive writes what `podman container restore --import` reads:
// podman's metadata and, in checkpoint/, descriptors.json, inventory.img
// and the serve socket's symlink (the images stream through it).
func importArchive(ctx context.Context, x criusock.Launch, path string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	add := func(name string, r io.Reader, size int64) error {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o600, Size: size, Typeflag: tar.TypeReg}); err != nil {
			return err
		}
		_, err := io.Copy(tw, r)
		return err
	}
	for _, n := range []string{configDump, specDump, "checkpoint/" + descriptors} {
		g, err := os.Open(filepath.Join(x.ImagesDir, filepath.Base(n)))
		if err != nil {
			return fmt.Errorf("podman import archive: %w", err)
		}
		st, err := g.Stat()
		if err == nil {
			err = add(n, g, st.Size())
		}
		g.Close()
		if err != nil {
			return fmt.Errorf("podman import archive: %s: %w", n, err)
		}
	}
	// From the checkpoint: inventory.img, and the root file system's
	// changes where there are any.
	for _, n := range []string{rootfsDiff, deletedFiles, "checkpoint/inventory.img"} {
		f, err := x.Src.Stat(ctx, filepath.Base(n))
		if errors.Is(err, errdefs.ErrNotFound) && n != "checkpoint/inventory.img" {
			continue
		}
		if err == nil {
			if err = tw.WriteHeader(&tar.Header{Name: n, Mode: 0o600, Size: f.Size, Typeflag: tar.TypeReg}); err == nil {
				_, err = x.Src.Copy(ctx, f.Name, tw)
			}
		}
		if err != nil {
			return fmt.Errorf("podman import archive: %s: %w", n, err)
		}
	}
	images, err := filepath.Abs(x.ImagesDir)
	if err != nil {
		return err
	}
	if err := tw.WriteHeader(&tar.Header{Name: "checkpoint/" + criusock.ServeSocket, Typeflag: tar.TypeSymlink, Mode: 0o777,
		Linkname: filepath.Join(images, criusock.ServeSocket)}); err != nil {
		return err
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return f.Close()
}
