// Package ctrtar reads and writes the checkpoint archives of Podman and
// CRI-O (`podman container checkpoint --export`, `restore --import`; the
// layout checkpointctl reads, its lib/metadata.go): a tar, plain or
// compressed with gzip or zstd, holding CRIU's images in checkpoint/ and
// the engine's files beside them: config.dump, spec.dump,
// rootfs-diff.tar, deleted.files, network.status, stats-dump, ...
//
// In a checkpoint of gpucr-stream the engine's files, and runc's
// descriptors.json of checkpoint/, are carried files (criusock/carry.go):
// a checkpoint taken through Podman (package container) holds them, and
// one imported from an archive too, so either converts into the other.
package ctrtar

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path"
	"strings"

	"github.com/klauspost/compress/zstd"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
)

// Names in the layout.
const (
	CheckpointDir = "checkpoint"
	ConfigDump    = "config.dump"
	SpecDump      = "spec.dump"
	// Descriptors is runc's record of the container's stdio, in
	// checkpoint/ although not CRIU's.
	Descriptors = "descriptors.json"
)

// Compression of an archive.
type Compression int

const (
	None Compression = iota
	Gzip
	Zstd
)

// CompressionFor is the compression an archive named path is written
// with (by its suffix: .tar, .tar.gz or .tgz, .tar.zst or .tar.zstd);
// false if path is not named as an archive.
func CompressionFor(path string) (Compression, bool) {
	switch {
	case strings.HasSuffix(path, ".tar"):
		return None, true
	case strings.HasSuffix(path, ".tar.gz"), strings.HasSuffix(path, ".tgz"):
		return Gzip, true
	case strings.HasSuffix(path, ".tar.zst"), strings.HasSuffix(path, ".tar.zstd"):
		return Zstd, true
	}
	return None, false
}

// The first bytes of a gzip and of a zstd stream.
var (
	gzipMagic = []byte{0x1f, 0x8b}
	zstdMagic = []byte{0x28, 0xb5, 0x2f, 0xfd}
)

// Sniff says whether b, the start of a file, is an archive: gzip, zstd, or
// a tar (its "ustar" magic at offset 257).
func Sniff(b []byte) bool {
	return bytes.HasPrefix(b, gzipMagic) || bytes.HasPrefix(b, zstdMagic) ||
		(len(b) >= 262 && string(b[257:262]) == "ustar")
}

// maxMetadata bounds config.dump and spec.dump, which are read whole.
const maxMetadata = 16 << 20

// maxDecoderMemory bounds a zstd decoder fed untrusted input.
const maxDecoderMemory = 256 << 20

// Meta is what an imported archive says of its container.
type Meta struct {
	// Engine is "podman", "cri-o" or "containerd" (checkpointctl's
	// reading of spec.dump's io.container.manager annotation), "" without
	// spec.dump.
	Engine string
	// Config is config.dump, where there is one.
	Config *Config
	// Files is the number of files imported.
	Files int
}

// Config is the part of config.dump both engines write
// (checkpointctl's ContainerConfig).
type Config struct {
	ID              string `json:"id"`
	Name            string `json:"name"`
	RootfsImage     string `json:"rootfsImage,omitempty"`
	RootfsImageRef  string `json:"rootfsImageRef,omitempty"`
	RootfsImageName string `json:"rootfsImageName,omitempty"`
	OCIRuntime      string `json:"runtime,omitempty"`
}

// decompress opens an archive's tar stream, whatever its compression.
func decompress(r io.Reader) (io.Reader, func(), error) {
	br := bufio.NewReaderSize(r, 512)
	head, _ := br.Peek(4)
	switch {
	case bytes.HasPrefix(head, gzipMagic):
		z, err := gzip.NewReader(br)
		if err != nil {
			return nil, nil, fmt.Errorf("gzip: %w: %w", err, errdefs.ErrCorrupt)
		}
		return z, func() { z.Close() }, nil
	case bytes.HasPrefix(head, zstdMagic):
		z, err := zstd.NewReader(br, zstd.WithDecoderMaxMemory(maxDecoderMemory), zstd.WithDecoderConcurrency(1))
		if err != nil {
			return nil, nil, err
		}
		return z, z.Close, nil
	}
	return br, func() {}, nil
}

// Sink takes the files of an imported archive (a *streamer.Capture).
type Sink interface {
	WriteFile(name string, r io.Reader, external bool) (int64, error)
	WriteCarried(name string, r io.Reader) (int64, error)
}

// Import writes every file of the archive r into c: the files of
// checkpoint/ under their names (CRIU's images as CRIU sends them,
// descriptors.json carried), the engine's beside them carried. It refuses
// what the layout does not hold (directories other than checkpoint/ with
// files in them, such as volumes/, hard links, devices).
func Import(ctx context.Context, r io.Reader, c Sink) (*Meta, error) {
	tr, closeTar, err := decompress(r)
	if err != nil {
		return nil, err
	}
	defer closeTar()
	rd := tar.NewReader(tr)
	m := &Meta{}
	seen := map[string]bool{}
	for {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		h, err := rd.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("archive: %w: %w", err, errdefs.ErrCorrupt)
		}
		if err := importEntry(h, rd, c, m, seen); err != nil {
			return nil, err
		}
	}
	if m.Files == 0 || !seen["inventory.img"] {
		return nil, fmt.Errorf("archive: no %s/inventory.img: not a checkpoint archive: %w", CheckpointDir, errdefs.ErrCorrupt)
	}
	return m, nil
}

func importEntry(h *tar.Header, r io.Reader, c Sink, m *Meta, seen map[string]bool) error {
	name := path.Clean(strings.TrimPrefix(h.Name, "./"))
	dir, base := path.Split(name)
	dir = strings.TrimSuffix(dir, "/")
	switch {
	case name == "." || name == CheckpointDir || h.Typeflag == tar.TypeDir:
		return nil // directories come with their files
	case h.Typeflag == tar.TypeSymlink && dir == CheckpointDir:
		return nil // a streamer socket's link (an archive made for a streamed import)
	case h.Typeflag != tar.TypeReg:
		return fmt.Errorf("archive: %s: entry type %q is not in a checkpoint archive: %w", manifest.PrintableName(name), h.Typeflag, errdefs.ErrUsage)
	case dir != "" && dir != CheckpointDir:
		return fmt.Errorf("archive: %s: files under %s/ are not carried (a named volume's archive: export with --ignore-volumes): %w",
			manifest.PrintableName(name), manifest.PrintableName(dir), errdefs.ErrUsage)
	case !manifest.ValidName(base) || seen[base]:
		return fmt.Errorf("archive: %s: a name twice, or not one a checkpoint holds: %w", manifest.PrintableName(name), errdefs.ErrCorrupt)
	}
	seen[base] = true
	m.Files++
	var err error
	switch {
	case dir == CheckpointDir && base != Descriptors:
		// CRIU's images, and its other files (logs) as external ones.
		_, err = c.WriteFile(base, r, !strings.HasSuffix(base, ".img"))
	case base == ConfigDump || base == SpecDump:
		err = importMetadata(base, r, c, m)
	default:
		_, err = c.WriteCarried(base, r)
	}
	if err != nil {
		return fmt.Errorf("archive: %s: %w", manifest.PrintableName(name), err)
	}
	return nil
}

// importMetadata carries config.dump or spec.dump and reads what it says
// of the container.
func importMetadata(name string, r io.Reader, c Sink, m *Meta) error {
	b, err := io.ReadAll(io.LimitReader(r, maxMetadata+1))
	if err != nil {
		return err
	}
	if len(b) > maxMetadata {
		return fmt.Errorf("over %d bytes: %w", maxMetadata, errdefs.ErrUsage)
	}
	if name == ConfigDump {
		var cd Config
		if json.Unmarshal(b, &cd) == nil {
			m.Config = &cd
		}
	} else {
		var spec struct {
			Annotations map[string]string `json:"annotations"`
		}
		if json.Unmarshal(b, &spec) == nil {
			m.Engine = engine(spec.Annotations["io.container.manager"])
		}
	}
	_, err = c.WriteCarried(name, bytes.NewReader(b))
	return err
}

// engine names the container engine as checkpointctl does.
func engine(manager string) string {
	switch manager {
	case "libpod":
		return "podman"
	case "cri-o":
		return "cri-o"
	}
	return "containerd"
}

// Export writes the checkpoint src as an archive into w: CRIU's images
// (and any file not carried) and descriptors.json in checkpoint/, the
// other carried files beside it.
func Export(ctx context.Context, src source.Source, w io.Writer, comp Compression) error {
	files, err := src.Files(ctx)
	if err != nil {
		return err
	}
	out, finish, err := compress(w, comp)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(out)
	if err := tw.WriteHeader(&tar.Header{Name: CheckpointDir + "/", Typeflag: tar.TypeDir, Mode: 0o700}); err != nil {
		return err
	}
	for _, f := range files {
		name := CheckpointDir + "/" + f.Name
		if f.Carried && f.Name != Descriptors {
			name = f.Name
		}
		if err := tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o600, Size: f.Size}); err != nil {
			return fmt.Errorf("archive: %s: %w", name, err)
		}
		if n, err := src.Copy(ctx, f.Name, tw); err != nil || n != f.Size {
			return fmt.Errorf("archive: %s: %d of %d bytes: %v", name, n, f.Size, err)
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return finish()
}

// compress wraps w; finish flushes the compressor.
func compress(w io.Writer, comp Compression) (io.Writer, func() error, error) {
	switch comp {
	case Gzip:
		z := gzip.NewWriter(w)
		return z, z.Close, nil
	case Zstd:
		z, err := zstd.NewWriter(w)
		if err != nil {
			return nil, nil, err
		}
		return z, z.Close, nil
	}
	return w, func() error { return nil }, nil
}
