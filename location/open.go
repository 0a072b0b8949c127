package location

// Opening a location: each kind (stdio, archive directory, stream file, S3,
// tcp://) is one type below with what it can be opened as; backend() is
// the one switch over the kind, and what a kind cannot be is refused by
// the embedded unsupported methods with a usage error.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/cisformat"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/s3"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/transport/tcp"
)

// Config is what opening a location needs besides the location: the
// standard streams, the pipeline's options and the settings of the remote
// kinds, all parsed already.
type Config struct {
	// Stdin and Stdout stand for "-"; tests hand in plain readers and
	// writers, which are used as they are.
	Stdin  io.Reader
	Stdout io.Writer
	// Shards are descriptors to spread a stream over (or gather it from)
	// instead of Stdin/Stdout.
	Shards []int
	// Options are the pipeline's options (chunk size, workers, memory for
	// chunks in flight, codec). Options.Key, when set, encrypts every
	// output opened (one new session per checkpoint) and is required by
	// every source: an encrypted one needs it, a plain one is refused.
	Options pipeline.Options
	// BufferLimit is what a stream source buffers in memory before
	// spilling to SpillDir; 0: half the available memory, at least 1 GiB.
	BufferLimit int64
	SpillDir    string
	// SegmentSize is the size of archive segment objects.
	SegmentSize int64
	// S3 returns the S3 settings (endpoint, region, path style, part size,
	// parallel uploads); bucket and prefix come from the location. It is
	// called only for an s3:// location, so that a bad S3 setting fails
	// only what uses S3.
	S3 func() (s3.Config, error)
	// TCP returns the tcp:// settings, likewise only for a tcp:// location.
	TCP func() (TCPConfig, error)
	// Log takes diagnostic lines ("listening on ADDR").
	Log func(string)
}

// TCPConfig is how a tcp:// location is reached or listened on.
type TCPConfig struct {
	Auth    tcp.Auth
	Timeout time.Duration
	Streams int
}

// Output is an opened DEST.
type Output struct {
	// Output is sealed (pipeline.Format) when Config.Options.Key was set,
	// and hashes its chunks when Config.Options.ChunkHashes was.
	streamer.Output
	// Sizes reports per-shard bytes of a stream destination (stdio,
	// tcp://); nil for archives, whose segments say it.
	Sizes func() []int64
	// Uploaded reports the bytes an object store acknowledged; nil for
	// other destinations.
	Uploaded func() int64
}

// OpenOutput opens a DEST for a capture, encrypted when c.Options.Key is
// set.
func OpenOutput(ctx context.Context, loc Location, c Config) (*Output, error) {
	return loc.backend().output(ctx, &c)
}

// Unwrap is the output opened.
func (o *Output) Unwrap() streamer.Output { return o.Output }

// dedupOutput opens a deduplicated checkpoint in ckpt, whose chunks go to
// the chunk store of the location that holds it.
func (c *Config) dedupOutput(ctx context.Context, ckpt store.Store) (*streamer.DedupOutput, error) {
	loc, name, ok := store.Parent(ckpt)
	if !ok {
		return nil, errdefs.Usagef("--dedup: %s is no checkpoint of a location (a directory or S3 prefix holding checkpoints)", ckpt)
	}
	if name+"/" == chunkstore.Dir {
		return nil, errdefs.Usagef("--dedup: %s is the location's chunk store, not a checkpoint name", ckpt)
	}
	f, err := c.Options.NewFormat()
	if err != nil {
		return nil, err
	}
	d, err := streamer.NewDedupOutput(ctx, ckpt, loc, c.SegmentSize, f.Seal)
	if err != nil {
		return nil, err
	}
	for _, b := range d.SkippedIndex() {
		c.log(fmt.Sprintf("warning: skipped an unreadable chunk index object; the chunks it lists are stored again (`gpucr-stream check --repair-index %s` rebuilds the index from the packs): %v", loc, b.Err))
	}
	return d, nil
}

// Format is what the output writes: a capture writing into it seals every
// chunk when it is sealed.
func (o *Output) Format() pipeline.Format { return streamer.FormatOf(o.Output) }

// WriteFrameAsync implements streamer.AsyncOutput: an archive's payload
// writes run on its own writers, any other output's at once.
func (o *Output) WriteFrameAsync(ctx context.Context, fh *manifest.FrameHeader, payload []byte, done func(error)) (streamer.FramePos, error) {
	if a, ok := o.Output.(streamer.AsyncOutput); ok {
		return a.WriteFrameAsync(ctx, fh, payload, done)
	}
	loc, err := o.Output.WriteFrame(ctx, fh, payload)
	if err == nil {
		done(nil)
	}
	return loc, err
}

// OpenSource opens a SRC. so are the stream source's own options
// (ExtractDir, Discard, VerifyHashes); the rest comes from c.
func OpenSource(ctx context.Context, loc Location, c Config, so source.StreamSourceOptions) (source.Source, error) {
	return loc.backend().source(ctx, &c, c.StreamSourceOptions(so))
}

// OpenStore opens a location that holds checkpoints (ls, rm, gc); close
// releases what the store holds.
func OpenStore(ctx context.Context, loc Location, c Config) (st store.Store, close func(), err error) {
	return loc.backend().store(ctx, &c)
}

// OpenDestStore opens a location to write one checkpoint into (cp DEST):
// a directory, created on the first write, or s3://BUCKET/PREFIX/NAME
// (--create-bucket applies).
func OpenDestStore(ctx context.Context, loc Location, c Config) (st store.Store, close func(), err error) {
	return loc.backend().destStore(ctx, &c)
}

// ReadManifest loads a checkpoint's description without decoding its data.
// Given c.Options.Key, an encrypted archive's manifest is authenticated too
// (a wrong key is refused) and authenticated says so; a stream's metadata
// is authenticated only by reading it whole (verify). Without the key an
// encrypted checkpoint's metadata is readable, not trusted.
func ReadManifest(ctx context.Context, loc Location, c Config) (m *manifest.Manifest, authenticated bool, err error) {
	return loc.backend().manifest(ctx, &c)
}

// archiveManifest reads an archive's manifest, authenticated when it is
// encrypted and c holds the key.
func (c *Config) archiveManifest(ctx context.Context, st store.Store) (*manifest.Manifest, bool, error) {
	m, err := source.ReadManifest(ctx, st)
	if err != nil || m.Encryption == nil || c.Options.Key == nil {
		return m, false, err
	}
	if m, err = source.CheckManifest(ctx, st, c.Options.Key); err != nil {
		return nil, false, err
	}
	return m, true, nil
}

type backend interface {
	output(ctx context.Context, c *Config) (*Output, error)
	source(ctx context.Context, c *Config, so source.StreamSourceOptions) (source.Source, error)
	store(ctx context.Context, c *Config) (store.Store, func(), error)
	destStore(ctx context.Context, c *Config) (store.Store, func(), error)
	manifest(ctx context.Context, c *Config) (*manifest.Manifest, bool, error)
}

func (l Location) backend() backend {
	switch l.Kind {
	case Stdio:
		return stdioLoc{}
	case Archive:
		return archiveLoc{unsupported{l}}
	case StreamFile:
		return streamFileLoc{unsupported{l}}
	case S3:
		return s3Loc{unsupported{l}}
	case TCP:
		return tcpLoc{unsupported{l}}
	}
	return unsupported{l}
}

// unsupported refuses what a kind of location cannot be opened as.
type unsupported struct{ loc Location }

func (u unsupported) output(context.Context, *Config) (*Output, error) {
	return nil, errdefs.Usagef("--to %s: this destination is not supported yet", u.loc)
}

func (u unsupported) source(context.Context, *Config, source.StreamSourceOptions) (source.Source, error) {
	return nil, errdefs.Usagef("source %s: not supported yet", u.loc)
}

func (u unsupported) store(context.Context, *Config) (store.Store, func(), error) {
	return nil, nil, errdefs.Usagef("want s3://BUCKET/PREFIX or a directory, got %s", u.loc)
}

func (u unsupported) destStore(context.Context, *Config) (store.Store, func(), error) {
	return nil, nil, errdefs.Usagef("DEST %s: want a directory or s3://BUCKET/PREFIX/NAME", u.loc)
}

func (u unsupported) manifest(context.Context, *Config) (*manifest.Manifest, bool, error) {
	return nil, false, errdefs.Usagef("%s: not supported yet", u.loc)
}

// StreamSourceOptions are the options a stream source opened with c gets
// (so's own, plus c's memory and spill settings); receive, which builds
// its source itself, starts from them too.
func (c Config) StreamSourceOptions(so source.StreamSourceOptions) source.StreamSourceOptions {
	so.Options = c.Options
	so.Options.MemoryLimit = c.BufferLimit
	if c.BufferLimit == 0 {
		so.Options.MemoryLimit = AutoBufferLimit()
	}
	so.Options.VerifyHashes = so.Options.VerifyHashes || so.Discard
	so.SpillDir = c.SpillDir
	return so
}

// archiveOptions are the options of an archive source.
func (c *Config) archiveOptions(so source.StreamSourceOptions) pipeline.Options {
	opts := c.Options
	opts.VerifyHashes = so.VerifyHashes || so.Discard
	return opts
}

// AutoBufferLimit is --memory-limit auto for the images serve and
// receive buffer: a multi-GB GPU image that fits in memory must not go
// through a spill file on disk on its way to CRIU, so half of what is
// available now, at least 1 GiB.
func AutoBufferLimit() int64 {
	return max(1<<30, proc.AvailableMemory()/2)
}

func (c *Config) log(msg string) {
	if c.Log != nil {
		c.Log(msg)
	}
}

func asFile(v any, fallback *os.File) *os.File {
	if f, ok := v.(*os.File); ok {
		return f
	}
	return fallback
}

// stdioLoc is "-": standard input or output, or the --shard-fds.
type stdioLoc struct{}

func (stdioLoc) output(_ context.Context, c *Config) (*Output, error) {
	ws, err := c.stdioWriters()
	if err != nil {
		return nil, err
	}
	format, err := c.Options.NewFormat()
	if err != nil {
		return nil, err
	}
	out, err := streamer.NewStreamOutputAs(ws, format)
	if err != nil {
		return nil, err
	}
	return &Output{Output: out, Sizes: out.Sizes}, nil
}

// stdioWriters are the shards' files, else stdout.
func (c *Config) stdioWriters() ([]io.Writer, error) {
	if _, ok := c.Stdout.(*os.File); !ok && c.Stdout != nil && len(c.Shards) == 0 {
		// Tests hand in writers: used as they are, fd 1 untouched (a second
		// *os.File on it would close it when collected).
		return []io.Writer{c.Stdout}, nil
	}
	files, _, err := ShardFiles(c.Shards, asFile(c.Stdout, os.Stdout))
	if err != nil {
		return nil, errdefs.Usagef("--shard-fds: %v", err)
	}
	ws := make([]io.Writer, len(files))
	for i, f := range files {
		if err := PrivateOutput(f); err != nil {
			return nil, err
		}
		ws[i] = f
	}
	return ws, nil
}

func (stdioLoc) source(ctx context.Context, c *Config, so source.StreamSourceOptions) (source.Source, error) {
	if _, ok := c.Stdin.(*os.File); !ok && c.Stdin != nil && len(c.Shards) == 0 {
		// Tests hand in readers, used as they are (see stdioWriters).
		return newStreamSource(ctx, []io.Reader{c.Stdin}, []string{"stdin"}, so)
	}
	files, names, err := ShardFiles(c.Shards, asFile(c.Stdin, os.Stdin))
	if err != nil {
		return nil, errdefs.Usagef("--shard-fds: %v", err)
	}
	rs := make([]io.Reader, len(files))
	for i, f := range files {
		rs[i] = f
	}
	if len(c.Shards) == 0 {
		names[0] = "stdin"
	}
	return newStreamSource(ctx, rs, names, so)
}

// newStreamSource reads a gpucr-stream stream, or one that
// criu-image-streamer wrote (told apart by their first bytes).
func newStreamSource(ctx context.Context, rs []io.Reader, names []string, so source.StreamSourceOptions) (source.Source, error) {
	rs, legacy, err := cisformat.Sniff(rs)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", names[0], err)
	}
	if legacy {
		return cisformat.NewSource(ctx, rs, names, nil, so), nil
	}
	return source.NewStreamSource(ctx, rs, names, so), nil
}

func (stdioLoc) store(context.Context, *Config) (store.Store, func(), error) {
	return nil, nil, errdefs.Usagef("want s3://BUCKET/PREFIX or a directory, got -")
}

func (stdioLoc) destStore(context.Context, *Config) (store.Store, func(), error) {
	return nil, nil, errdefs.Usagef("DEST -: cp writes checkpoints to a directory or s3://BUCKET/PREFIX/NAME (capture writes streams)")
}

func (stdioLoc) manifest(_ context.Context, c *Config) (*manifest.Manifest, bool, error) {
	m, err := source.ScanStream(c.Stdin, "stdin")
	return m, false, err
}

// archiveLoc is a local archive directory.
type archiveLoc struct{ unsupported }

func (a archiveLoc) output(ctx context.Context, c *Config) (*Output, error) {
	if err := refuseForeignDir(a.loc.Path); err != nil {
		return nil, err
	}
	if c.Options.Dedup {
		out, err := c.dedupOutput(ctx, dir.New(a.loc.Path))
		if err != nil {
			return nil, err
		}
		return &Output{Output: out}, nil
	}
	format, err := c.Options.NewFormat()
	if err != nil {
		return nil, err
	}
	out, err := streamer.NewArchiveOutputAs(ctx, dir.New(a.loc.Path), c.SegmentSize, format)
	if err != nil {
		return nil, err
	}
	return &Output{Output: out}, nil
}

// existing checks that a's directory is there: a missing one is not
// found, as a directory without a checkpoint in it is (source.OpenArchive
// says "no complete checkpoint there").
func (a archiveLoc) existing() error {
	st, err := os.Stat(a.loc.Path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%s: no such directory: %w", a.loc, errdefs.ErrNotFound)
	case err != nil:
		return err
	case !st.IsDir():
		return errdefs.Usagef("%s: not a directory", a.loc)
	}
	return nil
}

func (a archiveLoc) source(ctx context.Context, c *Config, so source.StreamSourceOptions) (source.Source, error) {
	if err := a.existing(); err != nil {
		return nil, err
	}
	return source.OpenArchive(ctx, dir.New(a.loc.Path), c.archiveOptions(so))
}

func (a archiveLoc) store(context.Context, *Config) (store.Store, func(), error) {
	if err := a.existing(); err != nil {
		return nil, nil, err
	}
	return dir.New(a.loc.Path), func() {}, nil
}

func (a archiveLoc) destStore(context.Context, *Config) (store.Store, func(), error) {
	return dir.New(a.loc.Path), func() {}, nil
}

func (a archiveLoc) manifest(ctx context.Context, c *Config) (*manifest.Manifest, bool, error) {
	if err := a.existing(); err != nil {
		return nil, false, err
	}
	return c.archiveManifest(ctx, dir.New(a.loc.Path))
}

// streamFileLoc is a file holding one stream (capture > FILE).
type streamFileLoc struct{ unsupported }

func (f streamFileLoc) output(context.Context, *Config) (*Output, error) {
	return nil, errdefs.Usagef("--to %s: a file is already there; capture writes archive directories (or use stdout: capture > FILE)", f.loc)
}

func (f streamFileLoc) source(ctx context.Context, _ *Config, so source.StreamSourceOptions) (source.Source, error) {
	file, err := os.Open(f.loc.Path)
	if err != nil {
		return nil, err
	}
	// A file that is no stream is refused now, before a restore starts
	// CRIU: its first bytes say.
	if err := checkStreamStart(file, f.loc.Path); err != nil {
		file.Close()
		return nil, err
	}
	src, err := newStreamSource(ctx, []io.Reader{file}, []string{f.loc.Path}, so)
	if err != nil {
		file.Close()
		return nil, err
	}
	return closeWith{src, file}, nil
}

func (f streamFileLoc) store(context.Context, *Config) (store.Store, func(), error) {
	return nil, nil, errdefs.Usagef("%s: a stream file holds one checkpoint and is not a location; use inspect", f.loc)
}

func (f streamFileLoc) manifest(_ context.Context, _ *Config) (*manifest.Manifest, bool, error) {
	file, err := os.Open(f.loc.Path)
	if err != nil {
		return nil, false, err
	}
	defer file.Close()
	m, err := source.ScanStream(file, f.loc.Path)
	return m, false, err
}

// closeWith closes an extra resource after the source.
type closeWith struct {
	source.Source
	c io.Closer
}

func (c closeWith) Close() error {
	err := c.Source.Close()
	c.c.Close()
	return err
}

// Manifest forwards what it wraps (source.Manifester).
func (c closeWith) Manifest() *manifest.Manifest { return source.ManifestOf(c.Source) }

// StreamOf returns the stream source behind src, if it is one.
func StreamOf(src source.Source) *source.StreamSource {
	switch s := src.(type) {
	case *source.StreamSource:
		return s
	case *cisformat.Source:
		return s.StreamSource
	case closeWith:
		return StreamOf(s.Source)
	}
	return nil
}

// ArchiveOf returns the archive source behind src, if it is one, for what
// only an archive does (Counters, ReaderAt, Behind, source.VerifyArchive):
// src as OpenSource returned it, through location's own wrappers. What
// other decorators need of an archive is its manifest: source.ManifestOf
// finds that through any of them.
func ArchiveOf(src source.Source) *source.ArchiveSource {
	switch s := src.(type) {
	case *source.ArchiveSource:
		return s
	case closeWith:
		return ArchiveOf(s.Source)
	}
	return nil
}

// LegacyOf returns the criu-image-streamer stream behind src, if it is one.
func LegacyOf(src source.Source) *cisformat.Source {
	switch s := src.(type) {
	case *cisformat.Source:
		return s
	case closeWith:
		return LegacyOf(s.Source)
	}
	return nil
}

// SourceCounters are the live totals of a source, for a progress bar, and
// the bytes it will serve when known.
func SourceCounters(src source.Source) (*pipeline.Counters, int64) {
	if a := ArchiveOf(src); a != nil {
		return &a.Counters, a.Manifest().Stats.RawBytes
	}
	if s := StreamOf(src); s != nil {
		return &s.Counters, 0
	}
	return nil, 0
}

// checkStreamStart checks that file starts as a stream does: a
// criu-image-streamer stream's marker, or a gpucr-stream header.
func checkStreamStart(file *os.File, name string) error {
	b := make([]byte, max(manifest.HeaderSize, cisformat.PrefixLen))
	n, err := file.ReadAt(b, 0)
	if err != nil && err != io.EOF {
		return fmt.Errorf("read %s: %w", name, err)
	}
	if n > 0 && cisformat.Detect(b[:min(n, cisformat.PrefixLen)]) {
		return nil
	}
	_, err = manifest.NewReader(io.NewSectionReader(file, 0, 1<<62), name)
	return err
}

// refuseForeignDir refuses to write an archive into a directory that holds
// files of its own: manifest.json and segments/ would be mixed into the
// user's files. A new or empty directory, or one a failed capture left
// (segments/ alone), is taken.
func refuseForeignDir(path string) error {
	ents, err := os.ReadDir(path)
	if err != nil {
		return nil // absent (made later), or not a directory (said later)
	}
	var foreign []string
	for _, e := range ents {
		n := e.Name()
		// segments/, manifest.json and the temporary file of a manifest
		// whose writer died (.manifest.json.tmp-N) are an archive's.
		if n != strings.TrimSuffix(manifest.SegmentPrefix, "/") && !strings.HasPrefix(strings.TrimPrefix(n, "."), manifest.ManifestName) {
			foreign = append(foreign, n)
		}
	}
	if len(foreign) == 0 {
		return nil
	}
	sort.Strings(foreign)
	more := ""
	if len(foreign) > 3 {
		foreign, more = foreign[:3], fmt.Sprintf(" and %d more", len(foreign)-3)
	}
	return errdefs.Usagef("--to %s: the directory holds other files (%s%s), not a checkpoint: give a new or empty directory", path, strings.Join(foreign, ", "), more)
}
