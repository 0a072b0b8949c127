package criusock

// --tcp-listen-remap, as criu-image-streamer's serve does it: the TCP
// sockets that listen on port OLD in the image listen on NEW after the
// restore. CRIU keeps them in files.img: an image header (two magics),
// then entries of a 4-byte little-endian length and a protobuf FileEntry;
// listening TCP sockets are entries with an InetSkEntry in state LISTEN.
// Only the entries that change are re-encoded; the rest are copied as they
// are.

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"sync"

	fdinfo "github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"google.golang.org/protobuf/proto"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
)

const (
	filesMagic = 0x56303138
	tcpListen  = 10 // netinet/tcp.h
	ipprotoTCP = 6
	// maxFilesImg bounds what is read of files.img (a few KiB in practice).
	maxFilesImg = 64 << 20
)

// ParseTCPRemap reads OLD:NEW,... into a map of ports.
func ParseTCPRemap(s string) (map[uint16]uint16, error) {
	out := map[uint16]uint16{}
	for _, item := range strings.Split(s, ",") {
		o, n, ok := strings.Cut(strings.TrimSpace(item), ":")
		old, err1 := strconv.ParseUint(o, 10, 16)
		nw, err2 := strconv.ParseUint(n, 10, 16)
		if !ok || err1 != nil || err2 != nil || old == 0 || nw == 0 {
			return nil, fmt.Errorf("%q is not OLD_PORT:NEW_PORT", item)
		}
		if _, dup := out[uint16(old)]; dup {
			return nil, fmt.Errorf("port %d remapped twice", old)
		}
		out[uint16(old)] = uint16(nw)
	}
	return out, nil
}

// RemapTCPListen returns src with files.img patched so that the TCP
// sockets listening on each OLD port of remaps listen on NEW. A port of
// remaps that no socket listens on is an error naming the ports that do.
func RemapTCPListen(ctx context.Context, src source.Source, remaps map[uint16]uint16) (source.Source, error) {
	if len(remaps) == 0 {
		return src, nil
	}
	r := &replaced{Source: src, remaps: remaps}
	if err := r.load(ctx); err != nil {
		return nil, err
	}
	return r, nil
}

// RemapTCPListenLater is RemapTCPListen for a source still arriving:
// files.img is read and patched when it is first asked for, and a port no
// socket listens on fails that request.
func RemapTCPListenLater(src source.Source, remaps map[uint16]uint16) source.Source {
	if len(remaps) == 0 {
		return src
	}
	return &replaced{Source: src, remaps: remaps}
}

const remappedFile = "files.img"

// load reads and patches files.img, once.
func (r *replaced) load(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.data != nil || r.err != nil {
		return r.err
	}
	img, err := readImage(ctx, r.Source, remappedFile, maxFilesImg)
	if err != nil {
		return fmt.Errorf("tcp listen remap: %w", err) // not kept: a canceled wait may be retried
	}
	patched, err := PatchTCPListen(img, r.remaps)
	if err != nil {
		r.err = fmt.Errorf("tcp listen remap: %s: %w", remappedFile, err)
		return r.err
	}
	r.data = patched
	return nil
}

// eachFileEntry walks the entries of a files.img and returns the image
// rebuilt from what fn returns for each (its raw bytes, or new ones).
func eachFileEntry(img []byte, fn func(fe *fdinfo.FileEntry, raw []byte, off int) ([]byte, error)) ([]byte, error) {
	out := slices.Clone(img[:min(len(img), 8)]) // the magics, checked by imageEntries
	err := imageEntries(img, filesMagic, func(raw []byte, off int) error {
		var fe fdinfo.FileEntry
		// Partial: CRIU's own readers do not insist on proto2's required fields.
		if err := (proto.UnmarshalOptions{AllowPartial: true}).Unmarshal(raw, &fe); err != nil {
			return fmt.Errorf("entry at offset %d: %v: %w", off, err, errdefs.ErrCorrupt)
		}
		raw, err := fn(&fe, raw, off)
		if err != nil {
			return err
		}
		out = binary.LittleEndian.AppendUint32(out, uint32(len(raw)))
		out = append(out, raw...)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("not a CRIU files image: %w", err)
	}
	return out, nil
}

// PatchTCPListen rewrites a files.img.
func PatchTCPListen(img []byte, remaps map[uint16]uint16) ([]byte, error) {
	left := map[uint16]bool{}
	for p := range remaps {
		left[p] = true
	}
	var listening []int
	out, err := eachFileEntry(img, func(fe *fdinfo.FileEntry, raw []byte, off int) ([]byte, error) {
		isk := fe.GetIsk()
		if isk == nil || isk.GetProto() != ipprotoTCP || isk.GetState() != tcpListen {
			return raw, nil
		}
		port := isk.GetSrcPort()
		listening = append(listening, int(port))
		nw, ok := remaps[uint16(port)]
		if !ok || port > 0xffff {
			return raw, nil
		}
		v := uint32(nw)
		isk.SrcPort = &v
		delete(left, uint16(port))
		raw, err := (proto.MarshalOptions{AllowPartial: true}).Marshal(fe)
		if err != nil {
			return nil, fmt.Errorf("entry at offset %d: %w", off, err)
		}
		return raw, nil
	})
	if err != nil {
		return nil, err
	}
	if len(left) > 0 {
		var missing []int
		for p := range left {
			missing = append(missing, int(p))
		}
		slices.Sort(missing)
		slices.Sort(listening)
		return nil, fmt.Errorf("no TCP socket listens on port %v in the image (listening ports: %v)", missing, listening)
	}
	return out, nil
}

// BoundTCPPorts lists the ports a files.img has CRIU bind() for TCP
// sockets that are not connections (listeners, sockets bound and not
// connected): connections are restored in repair mode, which binds over
// anything.
func BoundTCPPorts(img []byte) (map[uint16]bool, error) {
	ports := map[uint16]bool{}
	_, err := eachFileEntry(img, func(fe *fdinfo.FileEntry, raw []byte, _ int) ([]byte, error) {
		if isk := fe.GetIsk(); isk != nil && isk.GetProto() == ipprotoTCP && isk.GetDstPort() == 0 &&
			isk.GetSrcPort() != 0 && isk.GetSrcPort() <= 0xffff {
			ports[uint16(isk.GetSrcPort())] = true
		}
		return raw, nil
	})
	return ports, err
}

// replaced serves files.img patched in place of src's.
type replaced struct {
	source.Source
	remaps map[uint16]uint16
	mu     sync.Mutex
	data   []byte
	err    error
}

// Manifest forwards what it wraps (source.Manifester).
func (r *replaced) Manifest() *manifest.Manifest { return source.ManifestOf(r.Source) }

func (r *replaced) Stat(ctx context.Context, name string) (manifest.File, error) {
	f, err := r.Source.Stat(ctx, name)
	if err == nil && name == remappedFile {
		if err = r.load(ctx); err == nil {
			f.Size = int64(len(r.data))
		}
	}
	return f, err
}

func (r *replaced) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	if name != remappedFile {
		return r.Source.Copy(ctx, name, w)
	}
	if err := r.load(ctx); err != nil {
		return 0, err
	}
	n, err := w.Write(r.data)
	return int64(n), err
}

func (r *replaced) Files(ctx context.Context) ([]manifest.File, error) {
	fs, err := r.Source.Files(ctx)
	for i := range fs {
		if fs[i].Name == remappedFile && err == nil {
			if err = r.load(ctx); err == nil {
				fs[i].Size = int64(len(r.data))
			}
		}
	}
	return fs, err
}
