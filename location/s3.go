package location

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"runtime/debug"
	"strings"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/s3"
	"github.com/gpucr/gpucr-stream/streamer"
)

// s3Loc is s3://BUCKET/PREFIX.
type s3Loc struct{ unsupported }

// open connects to the bucket. s3.New checks the credentials and the
// bucket at once, so that a mistake is reported before any work starts: a
// missing bucket is "not found" (exit 4), missing or refused credentials a
// failure with a message that says which (exit 1).
//
// Only an output (write) creates a missing bucket, when the S3 settings
// say so (--create-bucket); otherwise its error says how.
func (l s3Loc) open(ctx context.Context, c *Config, write bool) (*s3.Store, s3.Config, error) {
	bucket, prefix, _ := strings.Cut(l.loc.Path, "/")
	if bucket == "" {
		return nil, s3.Config{}, errdefs.Usagef("%s: no bucket (want s3://BUCKET/PREFIX)", l.loc)
	}
	var sc s3.Config
	if c.S3 != nil {
		var err error
		if sc, err = c.S3(); err != nil {
			return nil, sc, err
		}
	}
	sc.Bucket, sc.Prefix = bucket, strings.Trim(prefix, "/")
	sc.CreateBucket = sc.CreateBucket && write
	if host := endpointHost(sc.Endpoint); host != "" && isLoopback(host) {
		// Nothing crosses a network: no plain-http warning.
		sc.Warn = func(string) {}
	}
	st, err := s3.New(ctx, sc)
	if err != nil {
		var dns *net.DNSError
		if errors.As(err, &dns) && dns.IsNotFound {
			if endpointHost(sc.Endpoint) == "" {
				return nil, sc, fmt.Errorf("%s: %w; no S3 endpoint is set, so this is AWS S3 itself: for another server (MinIO, ...) set --s3-endpoint or AWS_ENDPOINT_URL", l.loc, err)
			}
			return nil, sc, fmt.Errorf("%s: %w; check the host of --s3-endpoint (or AWS_ENDPOINT_URL)", l.loc, err)
		}
		if errors.Is(err, s3.ErrNoSuchBucket) && write {
			return nil, sc, fmt.Errorf("%w; create it (--create-bucket does, in --s3-region)", err)
		}
		// A missing bucket wraps errdefs.ErrNotFound already; these three
		// messages say enough on their own.
		if errors.Is(err, s3.ErrNoSuchBucket) || errors.Is(err, s3.ErrNoCredentials) || errors.Is(err, s3.ErrBadCredentials) {
			return nil, sc, err
		}
		return nil, sc, fmt.Errorf("%s: %w", l.loc, err)
	}
	return st, sc, nil
}

// output is an archive whose segments upload while CRIU still dumps,
// manifest last.
func (l s3Loc) output(ctx context.Context, c *Config) (*Output, error) {
	st, sc, err := l.open(ctx, c, true)
	if err != nil {
		return nil, err
	}
	if sc.SSE.Mode != s3.SSENone {
		// The server refuses an encryption it cannot do (no KMS, SSE-C
		// over http) only when an object is written: find out now, before
		// a checkpoint freezes its process, not at the first segment.
		if err := probeWrite(ctx, st); err != nil {
			st.Close()
			return nil, fmt.Errorf("%s: --s3-sse: a test object was refused: %w", l.loc, err)
		}
	}
	if c.Options.Dedup {
		out, err := c.dedupOutput(ctx, st)
		if err != nil {
			st.Close()
			return nil, err
		}
		out.SetLanes(1) // as below
		capMemoryTo(c.Options.MemoryLimit, int64(sc.Parallel+1+streamer.DefaultCommitting)*st.PartSize())
		return &Output{Output: out, Uploaded: st.Uploaded}, nil
	}
	format, err := c.Options.NewFormat()
	if err != nil {
		st.Close()
		return nil, err
	}
	out, err := streamer.NewArchiveOutputAs(ctx, st, c.SegmentSize, format)
	if err != nil {
		st.Close()
		return nil, err
	}
	// One segment at a time: an upload already runs Parallel parts at
	// once, and lanes would multiply the parts held in memory.
	out.SetLanes(1)
	// Parts in flight, the part being filled of the segment being written
	// and of those committing in the background (s3.Config.MaxInflight).
	capMemoryTo(c.Options.MemoryLimit, int64(sc.Parallel+1+streamer.DefaultCommitting)*st.PartSize())
	if _, ok := os.LookupEnv("GOGC"); !ok {
		debug.SetGCPercent(captureGCPercent)
	}
	return &Output{Output: out, Uploaded: st.Uploaded}, nil
}

// captureGCPercent replaces Go's default GOGC of 100 for captures into S3.
// Their heap is nearly all chunk buffers and part pieces, pooled and
// reused, and pointer-free, so that a collection does not scan them; what
// else they allocate is a few MB per GiB of image (BLAKE3's goroutines per
// hash, net/http's copy buffers). At 100 that garbage piled up until the
// heap was twice the buffers, a peak that grew with the image; at 10 a
// collection comes every GiB or so and costs a few ms of CPU.
const captureGCPercent = 10

// capMemoryTo makes the pipeline's memory limit, plus what the store holds
// beside the pipeline, the Go runtime's soft memory limit, so that the
// garbage collector keeps the process within its budgets however long the
// image (its default lets the heap grow to twice what is live).
// GOMEMLIMIT, when set, wins.
func capMemoryTo(pipeline, store int64) {
	if _, ok := os.LookupEnv("GOMEMLIMIT"); ok {
		return
	}
	const runtimeAndBuffers = 128 << 20 // stacks, pipes' buffers, clients
	debug.SetMemoryLimit(pipeline + store + runtimeAndBuffers)
}

// source reads chunks with ranged GETs in CRIU's order, a bounded window
// ahead; nothing is staged on disk.
func (l s3Loc) source(ctx context.Context, c *Config, so source.StreamSourceOptions) (source.Source, error) {
	st, sc, err := l.open(ctx, c, false)
	if err != nil {
		return nil, err
	}
	opts := c.archiveOptions(so)
	// Each read mostly waits on the network: keep more in flight than
	// there are cores.
	opts.Fetchers = max(opts.Fetchers, 2*sc.Parallel)
	src, err := source.OpenArchive(ctx, st, opts)
	if err != nil {
		st.Close()
		return nil, err
	}
	capMemoryTo(c.Options.MemoryLimit, 0)
	return src, nil
}

func (l s3Loc) store(ctx context.Context, c *Config) (store.Store, func(), error) {
	st, _, err := l.open(ctx, c, false)
	if err != nil {
		return nil, nil, err
	}
	return st, func() { st.Close() }, nil
}

func (l s3Loc) destStore(ctx context.Context, c *Config) (store.Store, func(), error) {
	st, _, err := l.open(ctx, c, true)
	if err != nil {
		return nil, nil, err
	}
	return st, func() { st.Close() }, nil
}

func (l s3Loc) manifest(ctx context.Context, c *Config) (*manifest.Manifest, bool, error) {
	st, _, err := l.open(ctx, c, false)
	if err != nil {
		return nil, false, err
	}
	defer st.Close()
	return c.archiveManifest(ctx, st)
}

// probeWrite writes and deletes a small object, as the store's settings
// (server-side encryption) write every object.
func probeWrite(ctx context.Context, st store.Store) error {
	w, err := st.Create(ctx, ".gpucr-write-probe")
	if err != nil {
		return err
	}
	if _, err := w.Write([]byte("gpucr-stream write probe\n")); err != nil {
		w.Abort(ctx)
		return err
	}
	if err := w.Commit(ctx); err != nil {
		w.Abort(ctx)
		return err
	}
	return st.Delete(ctx, ".gpucr-write-probe")
}

// endpointHost is the host of the S3 endpoint the store will use (ep, else
// the environment's, as s3.New reads it); "" for AWS S3 itself.
func endpointHost(ep string) string {
	for _, v := range []string{"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"} {
		if ep == "" {
			ep = os.Getenv(v)
		}
	}
	if ep == "" {
		return ""
	}
	if strings.Contains(ep, "://") {
		u, err := url.Parse(ep)
		if err != nil {
			return ""
		}
		return u.Hostname()
	}
	if h, _, err := net.SplitHostPort(ep); err == nil {
		return h
	}
	return ep
}

// isLoopback says whether host is this machine's loopback.
func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
