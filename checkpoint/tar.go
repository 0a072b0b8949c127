package checkpoint

// Podman's and CRI-O's checkpoint archives (package ctrtar) to and from
// gpucr-stream's locations: `cp ARCHIVE DEST` and `cp SRC ARCHIVE`.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/gpucr/gpucr-stream/container"
	"github.com/gpucr/gpucr-stream/ctrtar"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
)

// TarOptions are a conversion's: Archive is the archive's path, Loc the
// location on the other side.
type TarOptions struct {
	Archive string
	Loc     location.Location
	Open    location.Config
	Tool    string
	Hooks   Hooks
}

// TarResult is what a conversion moved.
type TarResult struct {
	Source      string  `json:"source"`
	Destination string  `json:"destination"`
	Files       int     `json:"files"`
	RawBytes    int64   `json:"raw_bytes"`
	StoredBytes int64   `json:"stored_bytes,omitempty"`
	Engine      string  `json:"engine,omitempty"`
	Container   string  `json:"container,omitempty"`
	TotalSecs   float64 `json:"total_seconds"`
}

// FromTar stores the archive as a checkpoint at o.Loc, committed like a
// checkpoint (the manifest last). The archive's container is recorded as
// a checkpoint through its engine records it (container.InfoFile), so
// `restore --container NAME --runtime podman` restores a Podman one.
func FromTar(ctx context.Context, o TarOptions) (*TarResult, error) {
	start := time.Now()
	f, err := os.Open(o.Archive)
	if err != nil {
		return nil, fmt.Errorf("cp: %w", err)
	}
	defer f.Close()
	c, out, err := location.StartCapture(ctx, o.Loc, o.Open)
	if err != nil {
		return nil, err
	}
	done := o.Hooks.progress(Progress{What: "cp", Counters: &c.Counters, Uploaded: out.Uploaded})
	defer done()
	meta, err := ctrtar.Import(ctx, f, c)
	if err == nil && meta.Config != nil {
		info := container.Info{Runtime: meta.Engine, ID: meta.Config.ID, Name: meta.Config.Name, Image: meta.Config.RootfsImageName}
		var b []byte
		if b, err = json.Marshal(info); err == nil {
			_, err = c.WriteCarried(container.InfoFile, bytes.NewReader(b))
		}
	}
	if err != nil {
		location.AbortCapture(ctx, c, err)
		return nil, fmt.Errorf("cp %s: %w", o.Archive, err)
	}
	m, err := c.Close(ctx, manifest.Manifest{Tool: o.Tool})
	if err != nil {
		return nil, fmt.Errorf("cp %s: %w", o.Archive, err)
	}
	res := &TarResult{Source: o.Archive, Destination: o.Loc.String(), Files: len(m.Files), RawBytes: m.Stats.RawBytes,
		StoredBytes: m.Stats.StoredBytes, Engine: meta.Engine, TotalSecs: time.Since(start).Seconds()}
	if meta.Config != nil {
		res.Container = meta.Config.Name
	}
	return res, nil
}

// ToTar writes the checkpoint at o.Loc as an archive at o.Archive,
// compressed as its name says, complete or not at all.
func ToTar(ctx context.Context, o TarOptions) (*TarResult, error) {
	start := time.Now()
	comp, ok := ctrtar.CompressionFor(o.Archive)
	if !ok {
		return nil, fmt.Errorf("cp: %s: an archive is named .tar, .tar.gz or .tar.zst", o.Archive)
	}
	src, done, err := o.Hooks.openSource(ctx, "cp", o.Loc, o.Open, source.StreamSourceOptions{})
	if err != nil {
		return nil, err
	}
	defer src.Close()
	defer done()
	tmp, err := os.CreateTemp(filepath.Dir(o.Archive), "."+filepath.Base(o.Archive)+".partial-*")
	if err != nil {
		return nil, fmt.Errorf("cp: %w", err)
	}
	defer os.Remove(tmp.Name())
	err = ctrtar.Export(ctx, src, tmp, comp)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), o.Archive)
	}
	if err != nil {
		return nil, fmt.Errorf("cp %s %s: %w", o.Loc, o.Archive, err)
	}
	files, err := src.Files(ctx)
	if err != nil {
		return nil, err
	}
	res := &TarResult{Source: o.Loc.String(), Destination: o.Archive, Files: len(files), TotalSecs: time.Since(start).Seconds()}
	for _, f := range files {
		res.RawBytes += f.Size
	}
	return res, nil
}
