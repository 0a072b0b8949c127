package checkpoint

// The criu-image-streamer flows: a capture beside `criu dump --stream`, a
// serve beside `criu restore --stream`, an extract into a plain images dir.
// CRIU is run by the caller; these only own the image-streamer sockets.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/streamer"
)

// ExtFile is an extra file carried in the stream, read from (capture) or
// written to (serve, extract) a descriptor.
type ExtFile struct {
	Name string
	FD   int
}

// ShardStats is one shard's entry of criu-image-streamer's statistics line.
type ShardStats struct {
	Size           int64 `json:"size"`
	TransferMillis int64 `json:"transfer_duration_millis"`
}

// Stats is criu-image-streamer's statistics line, which scripts parse; the
// fields after Shards are ours.
type Stats struct {
	Shards      []ShardStats `json:"shards"`
	Files       int          `json:"files"`
	RawBytes    int64        `json:"raw_bytes"`
	StoredBytes int64        `json:"stored_bytes"`
	Ratio       float64      `json:"ratio,omitempty"`
	DurationMS  int64        `json:"duration_ms"`
	Destination string       `json:"destination,omitempty"`
	Source      string       `json:"source,omitempty"`
}

// DropInOptions are the options of the criu-image-streamer drop-in flows:
// a capture's, serve's or extract's.
type DropInOptions struct {
	// ImagesDir is the directory given to criu with -D.
	ImagesDir string
	// Loc is the destination (capture) or source (serve, extract).
	Loc       location.Location
	Open      location.Config
	ExtFiles  []ExtFile
	Producers int
	// Tool is recorded in the manifest (capture).
	Tool  string
	Hooks Hooks
	// ConnectTimeout bounds the wait for CRIU to connect (capture, serve):
	// zero means criusock.DefaultConnectTimeout, negative no limit.
	ConnectTimeout time.Duration
	// TCPListenRemap moves TCP listening ports of the image, OLD to NEW
	// (serve).
	TCPListenRemap map[uint16]uint16
	// Early (serve) listens at once and answers CRIU's requests while the
	// stream is still being read: socket-init comes first and the
	// statistics line last, not in criu-image-streamer's order.
	Early bool
	// Carry names files of the images dir to carry (capture), or carried
	// files to wait for (serve --early; a serve otherwise writes every
	// carried file back into the images dir before it listens).
	Carry []string
}

// Capture takes the images of `criu dump --stream -D ImagesDir` (and the
// ext files, and the VRAM producers') and writes them to o.Loc.
func Capture(ctx context.Context, o DropInOptions) (*Stats, error) {
	start := time.Now()
	c, out, err := location.StartCapture(ctx, o.Loc, o.Open)
	if err != nil {
		return nil, err
	}
	done := o.Hooks.progress(Progress{What: "capture", Counters: &c.Counters, Uploaded: out.Uploaded})
	defer done()
	extErr := make(chan error, 1)
	go func() { extErr <- readExtFiles(o.ExtFiles, c) }()
	res, err := criusock.IntakeWith(ctx, o.ImagesDir, c, criusock.IntakeOptions{Hooks: criusock.Hooks{
		Listening: func() { o.Hooks.line("socket-init") },
		Connected: func() { o.Hooks.line("checkpoint-start") },
	}, Producers: o.Producers, ConnectTimeout: o.ConnectTimeout, Carry: o.Carry})
	if eerr := <-extErr; err == nil {
		err = eerr
	}
	if err == nil && !res.Complete {
		err = errors.New("criu closed the connection without sending inventory.img: the dump did not finish")
	}
	if err != nil {
		location.AbortCapture(ctx, c, err)
		return nil, fmt.Errorf("capture: %w", err)
	}
	m, err := c.Close(ctx, manifest.Manifest{Tool: o.Tool})
	done()
	if err != nil {
		return nil, fmt.Errorf("capture: %w", err)
	}
	elapsed := time.Since(start)
	st := &Stats{Files: len(m.Files), RawBytes: m.Stats.RawBytes, StoredBytes: m.Stats.StoredBytes, Ratio: m.Stats.Ratio(),
		DurationMS: elapsed.Milliseconds(), Destination: o.Loc.String()}
	if out.Sizes != nil {
		for _, n := range out.Sizes() {
			st.Shards = append(st.Shards, ShardStats{Size: n, TransferMillis: elapsed.Milliseconds()})
		}
	} else {
		for _, s := range m.Segments {
			st.Shards = append(st.Shards, ShardStats{Size: s.Size, TransferMillis: elapsed.Milliseconds()})
		}
	}
	o.Hooks.stats(st)
	return st, nil
}

// readExtFiles copies the external files from their descriptors into c,
// all at once; it returns the first failure.
func readExtFiles(files []ExtFile, c *streamer.Capture) error {
	return eachExtFile(files, func(e ExtFile, f *os.File) error {
		_, err := c.WriteFile(e.Name, f, true)
		return err
	})
}

// writeExtFiles copies the external files from src to their descriptors.
func writeExtFiles(ctx context.Context, files []ExtFile, src source.Source) error {
	return eachExtFile(files, func(e ExtFile, f *os.File) error {
		_, err := src.Copy(ctx, e.Name, f)
		return err
	})
}

func eachExtFile(files []ExtFile, fn func(ExtFile, *os.File) error) error {
	var wg sync.WaitGroup
	errs := make(chan error, len(files))
	for _, e := range files {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f := os.NewFile(uintptr(e.FD), "ext file "+e.Name)
			defer f.Close()
			if err := fn(e, f); err != nil {
				errs <- fmt.Errorf("ext file %s (fd %d): %w", e.Name, e.FD, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// Serve serves the images of o.Loc to `criu restore --stream -D
// ImagesDir`, and the ext files to their descriptors. As
// criu-image-streamer does, a stream is read and checked whole before the
// statistics line, and only then the socket listens (socket-init): drivers
// read the lines in that order, and a stream damaged anywhere never starts
// a restore. An archive is read in CRIU's order as it asks; its line comes
// first too. With o.Early the socket listens at once (serveEarly).
func Serve(ctx context.Context, o DropInOptions) (*Stats, error) {
	if o.Early {
		return serveEarly(ctx, o)
	}
	start := time.Now()
	src, done, err := o.Hooks.openSource(ctx, "restore", o.Loc, o.Open, source.StreamSourceOptions{})
	if err != nil {
		return nil, fmt.Errorf("serve: %w", err)
	}
	defer src.Close()
	defer done()
	if stream := location.StreamOf(src); stream != nil {
		if err := stream.Wait(ctx); err != nil {
			return nil, fmt.Errorf("serve: %w", explainSource(src, err))
		}
	}
	st, err := sourceStats(ctx, src, o.Loc, start)
	if err != nil {
		return nil, fmt.Errorf("serve: %w", explainSource(src, err))
	}
	served, err := criusock.RemapTCPListen(ctx, src, o.TCPListenRemap)
	if err != nil {
		return nil, fmt.Errorf("serve: %w", err)
	}
	carried, err := criusock.CarriedFiles(ctx, src)
	if err == nil {
		err = criusock.WriteCarried(ctx, src, o.ImagesDir, append(carried, o.Carry...))
	}
	if err != nil {
		return nil, fmt.Errorf("serve: %w", err)
	}
	o.Hooks.stats(st)
	if err := serveToCRIU(ctx, o, served); err != nil {
		return nil, fmt.Errorf("serve: %w", err)
	}
	done()
	return st, nil
}

// serveEarly is Serve with CRIU's restore overlapping the read of the
// stream: the socket listens at once, each file is served as soon as it
// has arrived whole and checked, a request for a file not there yet waits
// for it, and a file is answered absent only once the stream's end proves
// it is not in it. Nothing unchecked reaches CRIU, but a stream damaged
// after CRIU took all it asked for fails the serve after CRIU may have
// finished: the caller must then kill what it restored (restore --from
// does). The statistics line comes last, with the stream's totals.
func serveEarly(ctx context.Context, o DropInOptions) (*Stats, error) {
	start := time.Now()
	src, done, err := o.Hooks.openSource(ctx, "restore", o.Loc, o.Open, source.StreamSourceOptions{ServeEarly: true})
	if err != nil {
		return nil, fmt.Errorf("serve: %w", err)
	}
	defer src.Close()
	defer done()
	stream := location.StreamOf(src)
	ended, endedAt := make(chan struct{}), make(chan time.Time, 1)
	wctx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	if stream != nil {
		go func() {
			stream.Wait(wctx) // its error is Wait's below
			at := time.Now()
			close(ended)
			endedAt <- at
		}()
	} else {
		close(ended) // read in CRIU's order as it asks: nothing to overlap
		endedAt <- time.Time{}
	}
	first := &firstRequest{Source: criusock.RemapTCPListenLater(src, o.TCPListenRemap), log: o.Hooks.log, ended: ended}
	// Carried files arrive before CRIU's images: waiting for the named
	// ones costs little.
	err = criusock.WriteCarried(ctx, src, o.ImagesDir, append(criusock.CarriedIn(src), o.Carry...))
	if err == nil {
		err = serveToCRIU(ctx, o, first)
	}
	if stream != nil && err == nil {
		err = stream.Wait(ctx)
	}
	stopWatch()
	if end := <-endedAt; stream != nil && err == nil {
		o.Hooks.log(first.against(end))
	}
	var st *Stats
	if err == nil {
		st, err = sourceStats(ctx, src, o.Loc, start)
	}
	if err != nil {
		return nil, fmt.Errorf("serve: %w", explainSource(src, err))
	}
	done()
	o.Hooks.stats(st)
	return st, nil
}

// serveToCRIU serves src to CRIU's restore and the ext files to their
// descriptors.
func serveToCRIU(ctx context.Context, o DropInOptions, src source.Source) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	extErr := make(chan error, 1)
	go func() {
		err := writeExtFiles(ctx, o.ExtFiles, src)
		if err != nil {
			cancel(err) // CRIU must not wait on a serve that failed
		}
		extErr <- err
	}()
	buffering := o.Open.StreamSourceOptions(source.StreamSourceOptions{})
	_, err := criusock.ServeWith(ctx, o.ImagesDir, src, criusock.ServeOptions{Hooks: criusock.Hooks{
		Listening: func() { o.Hooks.line("socket-init") },
		Log:       o.Hooks.Log,
	}, Producers: o.Producers, ConnectTimeout: o.ConnectTimeout, MemoryLimit: buffering.MemoryLimit, SpillDir: buffering.SpillDir})
	if err != nil {
		if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
			err = cause
		}
		cancel(err)
	}
	if eerr := <-extErr; err == nil {
		err = eerr
	}
	return err
}

// firstRequest notes when CRIU first asked for a file, and logs it when
// the stream is still being read then: the proof that the restore
// overlaps the read.
type firstRequest struct {
	source.Source
	log   func(string)
	ended <-chan struct{} // closed at the stream's end
	mu    sync.Mutex
	name  string
	at    time.Time
}

func (f *firstRequest) Stat(ctx context.Context, name string) (manifest.File, error) {
	f.mu.Lock()
	if f.at.IsZero() {
		f.name, f.at = name, time.Now()
		select {
		case <-f.ended:
		default:
			f.log(fmt.Sprintf("serve: criu asked for its first file (%s) while the stream is still being read", manifest.PrintableName(name)))
		}
	}
	f.mu.Unlock()
	return f.Source.Stat(ctx, name)
}

// Manifest forwards what it wraps (source.Manifester).
func (f *firstRequest) Manifest() *manifest.Manifest { return source.ManifestOf(f.Source) }

// against says when CRIU's first request came against the stream's end.
func (f *firstRequest) against(end time.Time) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case f.at.IsZero():
		return "serve: criu asked for no file"
	case f.at.After(end):
		return fmt.Sprintf("serve: criu asked for its first file %d ms after the stream ended", f.at.Sub(end).Milliseconds())
	}
	return fmt.Sprintf("serve: criu asked for its first file %d ms before the stream ended", end.Sub(f.at).Milliseconds())
}

// Extract writes the image files of o.Loc into ImagesDir, and the ext
// files to their descriptors.
func Extract(ctx context.Context, o DropInOptions) (*Stats, error) {
	start := time.Now()
	src, done, err := o.Hooks.openSource(ctx, "extract", o.Loc, o.Open, source.StreamSourceOptions{ExtractDir: o.ImagesDir})
	if err != nil {
		return nil, fmt.Errorf("extract: %w", err)
	}
	defer src.Close()
	defer done()
	if stream := location.StreamOf(src); stream != nil {
		if _, err := stream.Files(ctx); err != nil {
			return nil, fmt.Errorf("extract: %w", explainSource(src, err))
		}
	} else if _, _, err = criusock.WriteExtract(ctx, src, o.ImagesDir); err != nil {
		return nil, fmt.Errorf("extract: %w", err)
	}
	if err := writeExtFiles(ctx, o.ExtFiles, src); err != nil {
		return nil, fmt.Errorf("extract: %w", err)
	}
	done()
	st, err := sourceStats(ctx, src, o.Loc, start)
	if err != nil {
		return nil, fmt.Errorf("extract: %w", err)
	}
	o.Hooks.stats(st)
	return st, nil
}

// sourceStats is the statistics line of a source read (serve, extract),
// meaning what criu-image-streamer's means: each shard's size is the bytes
// of its stream. An archive's "shards" are its segments, as capture
// reports them.
func sourceStats(ctx context.Context, src source.Source, loc location.Location, start time.Time) (*Stats, error) {
	files, err := src.Files(ctx)
	if err != nil {
		return nil, err
	}
	ms := time.Since(start).Milliseconds()
	st := &Stats{Files: len(files), DurationMS: ms, Source: loc.String()}
	for _, f := range files {
		st.RawBytes += f.Size
	}
	if l := location.LegacyOf(src); l != nil {
		for _, sh := range l.ShardStats() {
			st.Shards = append(st.Shards, ShardStats{Size: sh.Size, TransferMillis: sh.Duration.Milliseconds()})
			st.StoredBytes += sh.Size // stored raw, between its markers
		}
	} else if s := location.StreamOf(src); s != nil {
		for _, n := range s.ShardBytes() {
			st.Shards = append(st.Shards, ShardStats{Size: n, TransferMillis: ms})
		}
		st.StoredBytes = s.Counters.StoredBytes.Load()
	} else if m := source.ManifestOf(src); m != nil {
		for _, seg := range m.Segments {
			st.Shards = append(st.Shards, ShardStats{Size: seg.Size, TransferMillis: ms})
		}
		st.StoredBytes = m.Stats.StoredBytes
	}
	if len(st.Shards) == 0 {
		// A source of no known layout (tcp://), or an archive without
		// segments: drivers still read one shard.
		st.Shards = []ShardStats{{Size: st.StoredBytes, TransferMillis: ms}}
	}
	if st.StoredBytes > 0 {
		st.Ratio = float64(st.RawBytes) / float64(st.StoredBytes)
	}
	return st, nil
}

// explainSource names where a criu-image-streamer stream is damaged.
func explainSource(src source.Source, err error) error {
	if l := location.LegacyOf(src); l != nil {
		return l.Explain(err)
	}
	return err
}
