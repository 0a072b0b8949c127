package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime/debug"
	"strings"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store/s3"
	"github.com/gpucr/gpucr-stream/streamer"
)

// s3Config turns the --s3-* flags and an s3://BUCKET/PREFIX location into
// the store's configuration. Credentials are not flags: they come from the
// environment or the shared credentials file (s3.New), so that they
// never show in a process listing.
func s3Config(cfg *config, loc location.Location) (s3.Config, error) {
	bucket, prefix, _ := strings.Cut(loc.Path, "/")
	if bucket == "" {
		return s3.Config{}, usagef("%s: no bucket (want s3://BUCKET/PREFIX)", loc)
	}
	style, err := s3.ParsePathStyle(cfg.s3PathStyle)
	if err != nil {
		return s3.Config{}, usagef("--s3-path-style: %v", err)
	}
	part, err := parseSize(cfg.s3PartSize)
	if err != nil || part < 5<<20 || part > 5<<30 {
		return s3.Config{}, usagef("--s3-part-size %q: want a size from 5MiB to 5GiB", cfg.s3PartSize)
	}
	if cfg.s3Parallel < 1 || cfg.s3Parallel > 256 {
		return s3.Config{}, usagef("--s3-parallel %d: want 1..256", cfg.s3Parallel)
	}
	sse, err := s3.ParseSSE(cfg.s3SSE)
	if err != nil {
		return s3.Config{}, usagef("--s3-sse: %v", err)
	}
	if (sse.Mode == s3.SSEC) != (cfg.s3SSEKey != "") {
		return s3.Config{}, usagef("--s3-sse c and --s3-sse-key-file go together")
	}
	if sse.Mode == s3.SSEC {
		if sse.CustomerKey, err = crypt.ReadKeyFile(cfg.s3SSEKey); err != nil {
			return s3.Config{}, usagef("--s3-sse-key-file: %v", err)
		}
	}
	return s3.Config{
		SSE:       sse,
		Endpoint:  cfg.s3Endpoint,
		Bucket:    bucket,
		Prefix:    strings.Trim(prefix, "/"),
		Region:    cfg.s3Region,
		PathStyle: style,
		PartSize:  part,
		Parallel:  cfg.s3Parallel,
	}, nil
}

// openS3 connects to the bucket of an s3:// location. NewS3 checks the
// credentials and the bucket at once, so that a mistake is reported before
// any work starts: a missing bucket is "not found" (exit 4), missing or
// refused credentials a failure with a message that says which (exit 1).
func openS3(ctx context.Context, cfg *config, loc location.Location) (*s3.Store, error) {
	sc, err := s3Config(cfg, loc)
	if err != nil {
		return nil, err
	}
	store, err := s3.New(ctx, sc)
	if err != nil {
		switch {
		case errors.Is(err, s3.ErrNoSuchBucket):
			return nil, notFound{err}
		case errors.Is(err, s3.ErrNoCredentials), errors.Is(err, s3.ErrBadCredentials):
			return nil, err
		}
		return nil, fmt.Errorf("%s: %w", loc, err)
	}
	return store, nil
}

// openS3Output is openOutput for s3://BUCKET/PREFIX/NAME: an archive whose
// segments upload while CRIU still dumps, manifest last.
func openS3Output(ctx context.Context, cfg *config, loc location.Location) (streamer.Output, func() []int64, error) {
	store, err := openS3(ctx, cfg, loc)
	if err != nil {
		return nil, nil, err
	}
	out, err := streamer.NewSealedArchiveOutput(ctx, store, cfg.segSize, cfg.seal)
	if err != nil {
		store.Close()
		return nil, nil, err
	}
	cfg.uploaded = store.Uploaded
	// Parts in flight, the part being filled of the segment being written
	// and of those committing in the background (s3.Config.MaxInflight).
	capMemoryTo(cfg, int64(cfg.s3Parallel+1+streamer.DefaultCommitting)*store.PartSize())
	if _, ok := os.LookupEnv("GOGC"); !ok {
		debug.SetGCPercent(captureGCPercent)
	}
	return out, nil, nil
}

// captureGCPercent replaces Go's default GOGC of 100 for captures into S3.
// Their heap is nearly all chunk buffers and part pieces, pooled and
// reused, and pointer-free, so that a collection does not scan them; what
// else they allocate is a few MB per GiB of image (BLAKE3's goroutines per
// hash, net/http's copy buffers). At 100 that garbage piled up until the
// heap was twice the buffers, a peak that grew with the image; at 10 a
// collection comes every GiB or so and costs a few ms of CPU.
const captureGCPercent = 10

// capMemoryTo makes --memory-limit, plus what the store holds beside the
// pipeline, the Go runtime's soft memory limit, so that the garbage
// collector keeps the process within its budgets however long the image
// (its default lets the heap grow to twice what is live). GOMEMLIMIT, when
// set, wins.
func capMemoryTo(cfg *config, store int64) {
	if _, ok := os.LookupEnv("GOMEMLIMIT"); ok {
		return
	}
	const runtimeAndBuffers = 128 << 20 // stacks, pipes' buffers, clients
	debug.SetMemoryLimit(cfg.opts.MemoryLimit + store + runtimeAndBuffers)
}

// openS3Source is openSource for s3://BUCKET/PREFIX/NAME: chunks are read
// with ranged GETs in CRIU's order, a bounded window ahead; nothing is
// staged on disk.
func openS3Source(ctx context.Context, cfg *config, loc location.Location, opts streamer.Options) (*streamer.ArchiveSource, error) {
	store, err := openS3(ctx, cfg, loc)
	if err != nil {
		return nil, err
	}
	// Each read mostly waits on the network: keep more in flight than
	// there are cores.
	opts.Fetchers = max(opts.Fetchers, 2*cfg.s3Parallel)
	src, err := streamer.OpenArchive(ctx, store, opts)
	if err != nil {
		store.Close()
		return nil, err
	}
	capMemoryTo(cfg, 0)
	return src, nil
}

// readS3Manifest is readManifest for an s3:// location.
func readS3Manifest(ctx context.Context, cfg *config, loc location.Location) (*manifest.Manifest, error) {
	store, err := openS3(ctx, cfg, loc)
	if err != nil {
		return nil, err
	}
	defer store.Close()
	return streamer.ReadManifest(ctx, store)
}

// sourceCounters are the live totals of a source, for a progress bar, and
// the bytes it will serve when known.
func sourceCounters(src streamer.Source) (*streamer.Counters, int64) {
	if a, ok := src.(*streamer.ArchiveSource); ok {
		return &a.Counters, a.Manifest().Stats.RawBytes
	}
	if s := streamOf(src); s != nil {
		return &s.Counters, 0
	}
	return nil, 0
}

// notFound marks an error as "not found" (exit 4) without changing its
// message.
type notFound struct{ err error }

func (e notFound) Error() string   { return e.err.Error() }
func (e notFound) Unwrap() []error { return []error{e.err, errdefs.ErrNotFound} }
