package source

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/knobs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/store"
)

// maxManifest bounds the manifest read into memory (about 200 bytes a
// chunk: 64 MiB indexes well over a petabyte of 4 MiB chunks).
const maxManifest = 64 << 20

// ReadManifest reads and checks a committed archive's manifest. An
// encrypted archive's manifest is not authenticated here (that needs the
// key: OpenArchive, CheckManifest); its metadata is readable without it.
func ReadManifest(ctx context.Context, st store.Store) (*manifest.Manifest, error) {
	m, _, err := readManifest(ctx, st)
	return m, err
}

// CheckManifest reads an archive's manifest and, when it is encrypted,
// authenticates it with key. A key given for a plain archive is refused.
func CheckManifest(ctx context.Context, st store.Store, key *crypt.Key) (*manifest.Manifest, error) {
	m, _, err := openManifest(ctx, st, key)
	return m, err
}

func openManifest(ctx context.Context, st store.Store, key *crypt.Key) (*manifest.Manifest, *crypt.Session, error) {
	m, _, seal, err := openManifestDoc(ctx, st, key)
	return m, seal, err
}

// openManifestDoc is openManifest that also returns the document's bytes.
func openManifestDoc(ctx context.Context, st store.Store, key *crypt.Key) (*manifest.Manifest, []byte, *crypt.Session, error) {
	m, doc, err := readManifest(ctx, st)
	if err != nil {
		return nil, nil, nil, err
	}
	seal, err := pipeline.OpenSession(key, m.Encryption)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("%s: %w", st, err)
	}
	if seal != nil {
		if err := pipeline.CheckManifestMAC(doc, seal); err != nil {
			return nil, nil, nil, fmt.Errorf("%s/%s: %w", st, manifest.ManifestName, err)
		}
	}
	return m, doc, seal, nil
}

func readManifest(ctx context.Context, st store.Store) (*manifest.Manifest, []byte, error) {
	info, err := st.Stat(ctx, manifest.ManifestName)
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil, nil, fmt.Errorf("%s: no complete checkpoint there (%s missing): %w", st, manifest.ManifestName, errdefs.ErrNotFound)
		}
		return nil, nil, fmt.Errorf("%s: %w", st, err)
	}
	if info.Size > maxManifest {
		return nil, nil, fmt.Errorf("%s: %s is %d bytes, over the limit of %d", st, manifest.ManifestName, info.Size, maxManifest)
	}
	r, err := st.Open(ctx, manifest.ManifestName, 0, -1)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", st, err)
	}
	defer r.Close()
	b, err := io.ReadAll(io.LimitReader(r, maxManifest+1))
	if err != nil {
		return nil, nil, fmt.Errorf("%s: read %s: %w", st, manifest.ManifestName, err)
	}
	m, err := manifest.Parse(b)
	if err != nil {
		return nil, nil, fmt.Errorf("%s/%s: %w", st, manifest.ManifestName, err)
	}
	if m.SharedChunks {
		if err := checkPacks(m); err != nil {
			return nil, nil, fmt.Errorf("%s/%s: %w", st, manifest.ManifestName, err)
		}
	} else if len(m.Segments) == 0 && anyChunks(m) {
		// Validate checks segment references only when segments are listed.
		return nil, nil, fmt.Errorf("%s/%s: chunks but no segments: %w", st, manifest.ManifestName, errdefs.ErrCorrupt)
	}
	if m.ChunkSize <= 0 || m.ChunkSize > codec.MaxChunk {
		return nil, nil, fmt.Errorf("%s/%s: chunk size %d out of range", st, manifest.ManifestName, m.ChunkSize)
	}
	sealed := 0 // what sealing adds to each stored chunk
	if m.Encryption != nil {
		sealed = crypt.Overhead
		if m.SharedChunks {
			sealed = crypt.PackOverhead
		}
	}
	// An archive's chunks live in its segments: a manifest without them
	// (Validate checks segment references only when "segments" is there)
	// describes no archive.
	for _, f := range m.Files {
		for _, c := range f.Chunks {
			if codec.ID(c.Codec) != codec.Zero && (c.Segment < 0 || c.Segment >= len(m.Segments)) {
				return nil, nil, fmt.Errorf("%s/%s: file %s: chunk at offset %d in segment %d, but the archive lists %d segments: %w",
					st, manifest.ManifestName, manifest.PrintableName(f.Name), c.Offset, c.Segment, len(m.Segments), errdefs.ErrCorrupt)
			}
			// The read-ahead budget is counted in chunks of chunk_size: a
			// chunk larger than that would let a lying manifest hold many
			// times --memory-limit.
			if int(c.RawLen) > m.ChunkSize || int(c.Stored) > codec.MaxEncodedLen(codec.ID(c.Codec), m.ChunkSize)+sealed {
				return nil, nil, fmt.Errorf("%s/%s: file %s: chunk at offset %d holds %d bytes stored as %d, over the chunk size of %d: %w",
					st, manifest.ManifestName, manifest.PrintableName(f.Name), c.Offset, c.RawLen, c.Stored, m.ChunkSize, errdefs.ErrCorrupt)
			}
		}
	}
	return m, b, nil
}

// ArchiveSource serves files from an archive through its index, fetching
// and decoding each file's chunks in parallel with a bounded read-ahead, so
// memory stays bounded whatever the archive's size.
//
// Memory: every chunk fetched and not yet written holds a token. Tokens come
// from one budget shared by every file being copied (MemoryLimit divided by
// the buffers of one chunk), plus one token of each file's own, so that a
// file CRIU waits for always makes progress while another file's read-ahead
// holds the budget (CRIU reads pagemap and pages, and several processes'
// pages, at the same time). Each file reads ahead at most a window of
// chunks, fetched by Fetchers goroutines: a store's latency is hidden by
// reading ahead, not by holding more of the image.
type ArchiveSource struct {
	store store.Store
	// chunks holds the segments: the archive's own store, or for a
	// format 4 checkpoint the location that holds it (its chunk store).
	chunks   store.Store
	man      *manifest.Manifest
	byName   map[string]*manifest.File
	opts     pipeline.Options
	window   int
	parallel int
	tokens   chan struct{} // the shared budget
	pages    pagePool      // decoded chunks
	frames   pagePool      // a format 4 checkpoint's runs of frames (runs.go)
	payloads sync.Pool     // compressed payloads
	seal     *crypt.Session
	sums     pipeline.Digester
	// runs, for a format 4 checkpoint, are each file's chunks grouped
	// into reads (runs.go).
	runs map[string][]run
	// Counters count the bytes written out (RawBytes) and the payload
	// bytes read from the store (StoredBytes), for progress displays.
	Counters pipeline.Counters
}

// OpenArchive reads the manifest of a committed archive.
func OpenArchive(ctx context.Context, st store.Store, opts pipeline.Options) (*ArchiveSource, error) {
	m, seal, err := openManifest(ctx, st, opts.Key)
	if err != nil {
		return nil, err
	}
	if err := chunkstore.FindRepacked(ctx, st, m); err != nil {
		return nil, err
	}
	a := newArchiveSource(st, m, seal, opts)
	if err := a.findChunks(); err != nil {
		return nil, err
	}
	return a, nil
}

// findChunks points a format 4 checkpoint's reads at the location that
// holds it.
func (a *ArchiveSource) findChunks() error {
	if !a.man.SharedChunks {
		return nil
	}
	parent, _, ok := store.Parent(a.store)
	if !ok {
		return fmt.Errorf("%s: a deduplicated checkpoint (format 4) is read from the location that holds it, and %s has none: %w", a.store, a.store, errdefs.ErrNotFound)
	}
	a.chunks = parent
	return nil
}

// OpenArchiveAt reads and checks the manifest of the archive in src (with
// opts.Key when it is encrypted) and returns a source that reads the chunks
// it lists from at, and the manifest's bytes: cp checks a copy before it
// writes the manifest there.
func OpenArchiveAt(ctx context.Context, src, at store.Store, opts pipeline.Options) (*ArchiveSource, []byte, error) {
	m, doc, seal, err := openManifestDoc(ctx, src, opts.Key)
	if err != nil {
		return nil, nil, err
	}
	// The packs to copy are where src's location holds the chunks.
	if err := chunkstore.FindRepacked(ctx, src, m); err != nil {
		return nil, nil, err
	}
	a := newArchiveSource(at, m, seal, opts)
	if err := a.findChunks(); err != nil {
		return nil, nil, err
	}
	return a, doc, nil
}

func newArchiveSource(st store.Store, m *manifest.Manifest, seal *crypt.Session, opts pipeline.Options) *ArchiveSource {
	opts = opts.WithDefaults()
	a := &ArchiveSource{store: st, chunks: st, man: m, byName: map[string]*manifest.File{}, opts: opts, seal: seal, sums: pipeline.Digester{Seal: seal, NoChunkHashes: m.NoChunkHashes}}
	for i := range m.Files {
		a.byName[m.Files[i].Name] = &m.Files[i]
	}
	maxRaw, maxStored := chunkSizes(m)
	if m.SharedChunks {
		// Its chunks are read in runs of up to chunk_size (runs.go).
		maxRaw = max(maxRaw, int64(m.ChunkSize))
	}
	perChunk := maxRaw + maxStored + manifest.FrameSize // decoded chunk and frame
	budget := int(max(2, opts.MemoryLimit/perChunk))
	a.tokens = make(chan struct{}, budget)
	a.parallel = max(opts.Workers, opts.Fetchers)
	// Enough read-ahead to keep every fetcher busy while CRIU drains the
	// pipe, and no more. A store with latency to hide (Fetchers set: S3)
	// reads four chunks a core or two per fetcher ahead. A local one
	// answers at once: a chunk per core keeps the decoders busy, and a
	// deeper read-ahead costs CPU, CRIU's included, besides memory: each
	// chunk read ahead is a fresh buffer that the kernel zeroes and a
	// fetcher fills, and the later CRIU copies it out, the likelier it has
	// left the cache (docs/bench-log/2026-11.md, issue 13).
	a.window = max(2, min(budget, opts.Workers))
	if opts.Fetchers > 0 {
		a.window = max(2, min(budget, max(4*opts.Workers, 2*a.parallel)))
	}
	if readAhead > 0 {
		a.window = max(2, min(budget, readAhead))
	}
	a.parallel = min(a.parallel, a.window)
	a.pages = pagePool{size: int(maxRaw), keep: budget + 2}
	if m.SharedChunks {
		a.frames = pagePool{size: int(runSpan(maxRaw)), keep: budget + 2}
		a.runs = map[string][]run{}
		for i := range m.Files {
			a.runs[m.Files[i].Name] = runsOf(&m.Files[i], maxRaw, runSpan(maxRaw), runGap(maxRaw))
		}
	}
	a.payloads.New = func() any { b := make([]byte, maxStored); return &b }
	return a
}

// readAhead overrides the read-ahead window, in chunks, to measure other
// depths on other machines (GPUCR_READAHEAD=N).
var readAhead = knobs.ReadAhead.Int()

// Manifest is the archive's manifest.
func (a *ArchiveSource) Manifest() *manifest.Manifest { return a.man }

// Stat implements Source.
func (a *ArchiveSource) Stat(ctx context.Context, name string) (manifest.File, error) {
	f, ok := a.byName[name]
	if !ok {
		return manifest.File{}, fmt.Errorf("%s: %w", name, errdefs.ErrNotFound)
	}
	return *f, nil
}

// Files implements Source.
func (a *ArchiveSource) Files(ctx context.Context) ([]manifest.File, error) { return a.man.Files, nil }

// Close implements Source; it must not be called while a Copy runs.
func (a *ArchiveSource) Close() error {
	a.pages.close()
	a.frames.close()
	return nil
}

// fetched is one read ready to write: a chunk, or a run of them (runs.go).
// Its bytes are the pieces of raw, in order, which lie in page and frames;
// a zero chunk has none, and zero bytes of zeros. payload is the stored
// form a chunk was decoded from.
type fetched struct {
	raw     [][]byte
	zero    int64
	page    *pageBuf
	frames  *pageBuf
	inPlace bool // some of raw lies in frames (chunks stored raw)
	payload *[]byte
}

// unmap frees the page buffers that raw lies in once a pipe holds their
// pages: they must never be reused. A run's frames of encoded chunks only
// stay v's, to be reused.
func (v *fetched) unmap() {
	if v.page != nil {
		v.page.free()
		v.page = nil
	}
	if v.frames != nil && v.inPlace {
		v.frames.free()
		v.frames = nil
	}
}

func (a *ArchiveSource) drop(v fetched) {
	if v.payload != nil {
		a.payloads.Put(v.payload)
	}
	if v.page != nil {
		a.pages.put(v.page)
	}
	if v.frames != nil {
		a.frames.put(v.frames)
	}
}

func (a *ArchiveSource) payloadBuf(n int) *[]byte {
	b := a.payloads.Get().(*[]byte)
	if cap(*b) < n {
		nb := make([]byte, n)
		return &nb
	}
	*b = (*b)[:n]
	return b
}

// matchFrame checks fh, the header of the frame of chunk c of file f,
// against the manifest's entry for c: every field the manifest can say.
// The error names the first field that differs and its byte in the
// header. (The header's CRC, checked before, covers the rest: a file id
// where a plain manifest records none.)
func matchFrame(fh *manifest.FrameHeader, f *manifest.File, c *manifest.Chunk, m *manifest.Manifest) error {
	offset, fileID := uint64(c.Offset), fh.FileID
	switch {
	case m.SharedChunks:
		offset, fileID = 0, 0 // a pack's frame stands for its content
	case m.Encryption != nil:
		fileID = f.ID // sealed chunks are bound to it
	}
	fields := [...]struct {
		name      string
		at        int
		got, want uint64
	}{
		{"type", 0, uint64(fh.Type), uint64(manifest.FrameData)},
		{"codec", 1, uint64(fh.Codec), uint64(c.Codec)},
		{"flags", 2, uint64(fh.Flags), 0},
		{"file id", 4, uint64(fh.FileID), uint64(fileID)},
		{"offset", 8, fh.Offset, offset},
		{"raw length", 16, uint64(fh.RawLen), uint64(c.RawLen)},
		{"stored length", 20, uint64(fh.StoredLen), uint64(c.Stored)},
		{"checksum", 24, uint64(fh.Checksum), uint64(c.Checksum)},
	}
	for _, d := range fields {
		if d.got != d.want {
			return fmt.Errorf("frame does not match the index: header byte %d, %s, is %d, the manifest says %d: %w", d.at, d.name, d.got, d.want, errdefs.ErrCorrupt)
		}
	}
	if fh.Hash != c.Hash {
		return fmt.Errorf("frame does not match the index: header byte 28, hash, is %x, the manifest says %x: %w", fh.Hash, c.Hash, errdefs.ErrCorrupt)
	}
	return nil
}

// fetch reads one chunk's frame, checks it against the index and decodes it.
func (a *ArchiveSource) fetch(ctx context.Context, f *manifest.File, i int) (fetched, error) {
	c := f.Chunks[i]
	seg := a.man.Segments[c.Segment].Name
	where := func(format string, args ...any) error {
		return fmt.Errorf("%s: %s at offset %d (file %s, chunk at file offset %d): %w", a.chunks, seg, c.Pos, f.Name, c.Offset, fmt.Errorf(format, args...))
	}
	if codec.ID(c.Codec) == codec.Zero {
		// Encrypted: the authenticated index says zero; it has no CRC.
		if crc, hash := a.sums.Zero(int(c.RawLen)); (a.seal == nil && crc != c.Checksum) || (a.opts.VerifyHashes && hash != c.Hash) {
			return fetched{}, where("index marks a zero chunk whose checksum is not that of zeros: %w", errdefs.ErrCorrupt)
		}
		return fetched{zero: int64(c.RawLen)}, nil
	}
	page, err := a.pages.get(int(c.RawLen))
	if err != nil {
		return fetched{}, where("%w", err)
	}
	v := fetched{page: page}
	fail := func(err error) (fetched, error) {
		a.drop(v)
		return fetched{}, err
	}
	// A raw chunk is read straight into its page buffer, which is then
	// written out (or spliced) as it is.
	raw := page.b[:c.RawLen]
	payload := raw
	if codec.ID(c.Codec) != codec.None || a.seal != nil {
		v.payload = a.payloadBuf(int(c.Stored))
		payload = *v.payload
	} else if c.Stored != c.RawLen {
		return fail(where("raw chunk stores %d bytes for %d: %w", c.Stored, c.RawLen, errdefs.ErrCorrupt))
	}
	r, err := a.chunks.Open(ctx, seg, c.Pos, manifest.FrameSize+int64(c.Stored))
	if err != nil {
		return fail(where("%w", err))
	}
	var hdr [manifest.FrameSize]byte
	_, err = io.ReadFull(r, hdr[:])
	if err == nil {
		_, err = io.ReadFull(r, payload)
	}
	r.Close()
	if err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			err = fmt.Errorf("%w: %w", err, errdefs.ErrCorrupt)
		}
		return fail(where("read frame: %w", err))
	}
	fh, err := manifest.UnmarshalFrameHeader(hdr[:])
	if err != nil {
		return fail(where("%w: %w", err, errdefs.ErrCorrupt))
	}
	if err := matchFrame(&fh, f, &c, a.man); err != nil {
		return fail(where("%w", err))
	}
	if err := a.decode(raw, f, c, payload); err != nil {
		return fail(where("%w", err))
	}
	if a.opts.VerifyHashes && a.sums.Content(raw) != c.Hash {
		return fail(where("content hash mismatch: %w", errdefs.ErrCorrupt))
	}
	v.raw = [][]byte{raw}
	a.Counters.StoredBytes.Add(int64(c.Stored))
	a.Counters.StoredRaw.Add(int64(c.RawLen))
	return v, nil
}

// chunkSizes are the largest decoded and stored sizes of the archive's
// chunks: what one chunk in flight holds at most, by the sizes it actually
// has (ReadManifest bounds both by chunk_size).
func chunkSizes(m *manifest.Manifest) (raw, stored int64) {
	for _, f := range m.Files {
		for _, c := range f.Chunks {
			raw, stored = max(raw, int64(c.RawLen)), max(stored, int64(c.Stored))
		}
	}
	return max(raw, 1), stored
}

// checkPacks checks what format 4 adds: every segment is a pack of the
// location's chunk store (a manifest must not point reads at other objects
// there), and every stored chunk has its id and a segment.
func checkPacks(m *manifest.Manifest) error {
	for _, s := range m.Segments {
		if _, ok := chunkstore.ParsePackName(s.Name); !ok {
			return fmt.Errorf("segment %s is not a pack of the chunk store: %w", manifest.PrintableName(s.Name), errdefs.ErrCorrupt)
		}
	}
	for _, f := range m.Files {
		for _, c := range f.Chunks {
			if codec.ID(c.Codec) == codec.Zero {
				continue
			}
			if c.Hash == (manifest.Hash{}) || c.Segment < 0 || c.Segment >= len(m.Segments) {
				return fmt.Errorf("file %s: chunk at offset %d has no id or no pack: %w", manifest.PrintableName(f.Name), c.Offset, errdefs.ErrCorrupt)
			}
		}
	}
	return nil
}

func anyChunks(m *manifest.Manifest) bool {
	for _, f := range m.Files {
		if len(f.Chunks) > 0 {
			return true
		}
	}
	return false
}

// decode opens (when sealed) and decodes chunk c of f from its stored
// payload into raw, checking its CRC-32C.
func (a *ArchiveSource) decode(raw []byte, f *manifest.File, c manifest.Chunk, payload []byte) error {
	enc, sum, err := a.open(f, c, payload)
	if err != nil {
		return err
	}
	return decodeChunk(raw, c.Codec, sum, enc)
}

// open authenticates and decrypts a sealed payload in place; it returns
// the encoded chunk and its raw bytes' CRC-32C (the index's, unsealed).
func (a *ArchiveSource) open(f *manifest.File, c manifest.Chunk, payload []byte) ([]byte, uint32, error) {
	switch {
	case a.seal == nil:
		return payload, c.Checksum, nil
	case a.man.SharedChunks:
		// Sealed for the chunk store: bound to its keyed id.
		return a.seal.OpenShared(payload, c.Hash, c.RawLen, c.Codec)
	}
	ch := crypt.Chunk{FileID: f.ID, Name: f.Name, Offset: uint64(c.Offset), RawLen: c.RawLen, Codec: c.Codec}
	return openChunk(a.seal, payload, ch)
}
