package criusock

// Carried files: files the caller puts into CRIU's images dir before or
// during a dump ride in the checkpoint (flagged manifest.FileFlagCarried)
// and are written back into the images dir before CRIU runs on restore.
// runc writes descriptors.json there before it starts CRIU and reads it
// back before a restore; --carry NAME names others. A file is taken as it
// is when CRIU connects, or else at CRIU's post-dump (the end of the dump
// for a capture run beside CRIU): a caller writing one during the dump
// puts it there whole (a rename).

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/streamer"
)

// DefaultCarry is carried whenever it is there: runc's record of the
// container's stdio, which `runc restore` reads from the images dir.
var DefaultCarry = []string{"descriptors.json"}

// CheckCarry refuses what cannot be carried: a name CRIU's own images
// could take (*.img) or the streamer's files. A relative path names a
// file in the images dir; an absolute one any file, carried under its
// base name.
func CheckCarry(paths []string) error {
	for _, p := range paths {
		name := filepath.Base(p)
		switch {
		case p == "" || !ValidImageName(name) || (!filepath.IsAbs(p) && strings.Contains(p, "/")):
			return errdefs.Usagef("--carry %q: want a file name in the images dir, or an absolute path", p)
		case strings.HasSuffix(name, ".img") || name == CaptureSocket || name == ServeSocket:
			return errdefs.Usagef("--carry %q: %s is a name of CRIU's images or sockets", p, name)
		}
	}
	return nil
}

// carrier takes the carried files of one dump into a capture, each once.
type carrier struct {
	dir   string
	items []carryItem
	mu    sync.Mutex
}

type carryItem struct {
	path, name string
	required   bool // named by the caller: missing at the end fails the dump
	done       bool
}

func newCarrier(dir string, required []string) *carrier {
	k := &carrier{dir: dir}
	seen := map[string]bool{}
	for _, list := range []struct {
		paths    []string
		required bool
	}{{required, true}, {DefaultCarry, false}} {
		for _, p := range list.paths {
			name := filepath.Base(p)
			if seen[name] {
				continue
			}
			seen[name] = true
			k.items = append(k.items, carryItem{path: p, name: name, required: list.required})
		}
	}
	return k
}

// take writes the files there now, not taken before, into c. A final
// take is the last: a required file missing then fails it, and nothing
// is taken afterwards.
func (k *carrier) take(c *streamer.Capture, final bool) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	for i := range k.items {
		it := &k.items[i]
		if it.done {
			continue
		}
		f, err := k.open(it.path)
		switch {
		case errors.Is(err, fs.ErrNotExist) && final && it.required:
			return fmt.Errorf("carry %s: not in %s at the end of the dump", it.path, k.dir)
		case errors.Is(err, fs.ErrNotExist):
			it.done = final
			continue
		case err != nil:
			return fmt.Errorf("carry %s: %w", it.path, err)
		}
		_, err = c.WriteCarried(it.name, f)
		f.Close()
		if err != nil {
			return fmt.Errorf("carry %s: %w", it.path, err)
		}
		it.done = true
	}
	return nil
}

// open opens a regular file to carry; one in the images dir is not
// followed if it is a symlink.
func (k *carrier) open(p string) (*os.File, error) {
	flags := os.O_RDONLY
	if !filepath.IsAbs(p) {
		p, flags = filepath.Join(k.dir, p), flags|unix.O_NOFOLLOW
	}
	f, err := os.OpenFile(p, flags, 0)
	if err != nil {
		return nil, err
	}
	if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("%s is not a regular file", p)
	}
	return f, nil
}

// onConnect is what runs when CRIU connects to an intake: hooks.Connected,
// then the carried files there by then, which so go first into the image.
func (in *IntakeSession) onConnect(s *session, hooks Hooks) func() {
	return func() {
		if hooks.Connected != nil {
			hooks.Connected()
		}
		if err := in.carry.take(in.c, false); err != nil {
			s.abort(err)
		}
	}
}

// CarriedIn lists the carried files a source names without waiting: an
// archive's manifest; nil for a stream still being read.
func CarriedIn(src source.Source) []string {
	m := source.ManifestOf(src)
	if m == nil {
		return nil
	}
	return carriedOf(m.Files)
}

func carriedOf(files []manifest.File) []string {
	var names []string
	for _, f := range files {
		if f.Carried {
			names = append(names, f.Name)
		}
	}
	return names
}

// CarriedFiles lists every carried file of a source, waiting for a
// stream to be read whole.
func CarriedFiles(ctx context.Context, src source.Source) ([]string, error) {
	files, err := src.Files(ctx)
	if err != nil {
		return nil, err
	}
	return carriedOf(files), nil
}

// WriteCarried writes the named files of src into dir (CRIU's images
// dir), each whole or not at all, before CRIU runs. Stat waits for a
// file of a stream still arriving; a name the checkpoint lacks is an
// error wrapping errdefs.ErrNotFound.
func WriteCarried(ctx context.Context, src source.Source, dir string, names []string) error {
	seen := map[string]bool{}
	var files []manifest.File
	for _, n := range names {
		if seen[n] {
			continue
		}
		seen[n] = true
		f, err := src.Stat(ctx, n)
		if err != nil {
			return fmt.Errorf("carried file %s: %w", n, err)
		}
		files = append(files, f)
	}
	_, _, err := writeFiles(ctx, src, dir, files)
	return err
}
