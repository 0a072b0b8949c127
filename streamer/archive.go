package streamer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
)

// maxManifest bounds the manifest read into memory (about 200 bytes a
// chunk: 64 MiB indexes well over a petabyte of 4 MiB chunks).
const maxManifest = 64 << 20

// ReadManifest reads and checks a committed archive's manifest.
func ReadManifest(ctx context.Context, store Store) (*manifest.Manifest, error) {
	info, err := store.Stat(ctx, manifest.ManifestName)
	if err != nil {
		if errors.Is(err, ErrNotExist) {
			return nil, fmt.Errorf("%s: no complete checkpoint there (%s missing): %w", store, manifest.ManifestName, ErrNotExist)
		}
		return nil, fmt.Errorf("%s: %w", store, err)
	}
	if info.Size > maxManifest {
		return nil, fmt.Errorf("%s: %s is %d bytes, over the limit of %d", store, manifest.ManifestName, info.Size, maxManifest)
	}
	r, err := store.Open(ctx, manifest.ManifestName, 0, -1)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", store, err)
	}
	defer r.Close()
	b, err := io.ReadAll(io.LimitReader(r, maxManifest+1))
	if err != nil {
		return nil, fmt.Errorf("%s: read %s: %w", store, manifest.ManifestName, err)
	}
	m, err := manifest.Parse(b)
	if err != nil {
		return nil, fmt.Errorf("%s/%s: %w", store, manifest.ManifestName, err)
	}
	if m.ChunkSize <= 0 || m.ChunkSize > codec.MaxChunk {
		return nil, fmt.Errorf("%s/%s: chunk size %d out of range", store, manifest.ManifestName, m.ChunkSize)
	}
	return m, nil
}

// ArchiveSource serves files from an archive through its index, fetching
// and decoding each file's chunks in parallel with a bounded read-ahead, so
// memory stays bounded whatever the archive's size.
type ArchiveSource struct {
	store  Store
	man    *manifest.Manifest
	byName map[string]*manifest.File
	opts   Options
	window int
	pool   sync.Pool
}

// OpenArchive reads the manifest of a committed archive.
func OpenArchive(ctx context.Context, store Store, opts Options) (*ArchiveSource, error) {
	m, err := ReadManifest(ctx, store)
	if err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	a := &ArchiveSource{store: store, man: m, byName: map[string]*manifest.File{}, opts: opts}
	for i := range m.Files {
		a.byName[m.Files[i].Name] = &m.Files[i]
	}
	// Per-file read-ahead; CRIU reads a few files at once (pagemap and pages),
	// so the budget is shared by a handful of copies.
	a.window = int(opts.MemoryLimit / int64(2*m.ChunkSize) / 4)
	a.window = max(2, min(a.window, 4*opts.Workers))
	size := m.ChunkSize + manifest.FrameSize
	a.pool.New = func() any { b := make([]byte, size); return &b }
	return a, nil
}

// Manifest is the archive's manifest.
func (a *ArchiveSource) Manifest() *manifest.Manifest { return a.man }

// Stat implements Source.
func (a *ArchiveSource) Stat(ctx context.Context, name string) (manifest.File, error) {
	f, ok := a.byName[name]
	if !ok {
		return manifest.File{}, fmt.Errorf("%s: %w", name, ErrNotExist)
	}
	return *f, nil
}

// Files implements Source.
func (a *ArchiveSource) Files(ctx context.Context) ([]manifest.File, error) { return a.man.Files, nil }

// Close implements Source.
func (a *ArchiveSource) Close() error { return nil }

type fetched struct {
	raw  []byte
	zero int64
	bufs []*[]byte
}

// Copy implements Source.
func (a *ArchiveSource) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	f, ok := a.byName[name]
	if !ok {
		return 0, fmt.Errorf("%s: %w", name, ErrNotExist)
	}
	var written int64
	err := ordered(ctx, len(f.Chunks), a.opts.Workers, a.window,
		func(ctx context.Context, i int) (fetched, error) { return a.fetch(ctx, f, i) },
		func(i int, v fetched) error {
			var err error
			if v.raw == nil {
				err = writeZeros(w, v.zero)
			} else {
				_, err = w.Write(v.raw)
			}
			if err != nil {
				return fmt.Errorf("write %s at offset %d: %w", name, f.Chunks[i].Offset, err)
			}
			written += int64(f.Chunks[i].RawLen)
			return nil
		},
		func(v fetched) {
			for _, b := range v.bufs {
				a.pool.Put(b)
			}
		})
	return written, err
}

func (a *ArchiveSource) getBuf(n int) *[]byte {
	b := a.pool.Get().(*[]byte)
	if cap(*b) < n {
		nb := make([]byte, n)
		return &nb
	}
	*b = (*b)[:n]
	return b
}

// fetch reads one chunk's frame, checks it against the index and decodes it.
func (a *ArchiveSource) fetch(ctx context.Context, f *manifest.File, i int) (fetched, error) {
	c := f.Chunks[i]
	seg := a.man.Segments[c.Segment].Name
	where := func(format string, args ...any) error {
		return fmt.Errorf("%s: %s at offset %d (file %s, chunk at file offset %d): %w", a.store, seg, c.Pos, f.Name, c.Offset, fmt.Errorf(format, args...))
	}
	if codec.ID(c.Codec) == codec.Zero {
		if crc, hash := zeroSums(int(c.RawLen)); crc != c.Checksum || (a.opts.VerifyHashes && hash != c.Hash) {
			return fetched{}, where("index marks a zero chunk whose checksum is not that of zeros: %w", manifest.ErrCorrupt)
		}
		return fetched{zero: int64(c.RawLen)}, nil
	}
	frame := a.getBuf(manifest.FrameSize + int(c.Stored))
	v := fetched{bufs: []*[]byte{frame}}
	fail := func(err error) (fetched, error) {
		for _, b := range v.bufs {
			a.pool.Put(b)
		}
		return fetched{}, err
	}
	r, err := a.store.Open(ctx, seg, c.Pos, int64(len(*frame)))
	if err != nil {
		return fail(where("%w", err))
	}
	_, err = io.ReadFull(r, *frame)
	r.Close()
	if err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			err = fmt.Errorf("%w: %w", err, manifest.ErrCorrupt)
		}
		return fail(where("read frame: %w", err))
	}
	fh, err := manifest.UnmarshalFrameHeader(*frame)
	if err != nil {
		return fail(where("%w: %w", err, manifest.ErrCorrupt))
	}
	if fh.Type != manifest.FrameData || fh.Offset != uint64(c.Offset) || fh.RawLen != c.RawLen ||
		fh.StoredLen != c.Stored || fh.Codec != c.Codec || fh.Checksum != c.Checksum {
		return fail(where("frame does not match the index: %w", manifest.ErrCorrupt))
	}
	payload := (*frame)[manifest.FrameSize:]
	raw := payload
	if codec.ID(c.Codec) != codec.None {
		rb := a.getBuf(int(c.RawLen))
		v.bufs = append(v.bufs, rb)
		raw = *rb
	}
	if err := decodeChunk(raw, c.Codec, c.Checksum, payload); err != nil {
		return fail(where("%w", err))
	}
	if a.opts.VerifyHashes && codec.ContentHash(raw) != c.Hash {
		return fail(where("content hash mismatch: %w", manifest.ErrCorrupt))
	}
	v.raw = raw
	return v, nil
}
