package sinks

import (
	"bytes"
	"context"
	"crypto/md5"
	"crypto/x509"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/streamer"
)

// S3 limits and defaults.
const (
	// DefaultS3PartSize is the multipart part size: large enough that
	// per-request overhead does not matter, small enough that a handful in
	// flight fit in a modest memory budget. minio-go's own default for
	// streams of unknown length is about 537 MiB per part, per thread.
	DefaultS3PartSize = 16 << 20
	// DefaultS3Parallel is the number of parts in flight per object.
	DefaultS3Parallel = 4
	// DefaultS3MaxRetries is how often a failed request is retried.
	DefaultS3MaxRetries = 6

	minS3PartSize = 5 << 20 // S3's minimum for every part but the last
	maxS3PartSize = 5 << 30
	maxS3Parts    = 10000

	retryBase = 250 * time.Millisecond
	retryCap  = 8 * time.Second

	// commitCleanupTimeout bounds the abort of an upload whose commit
	// failed.
	commitCleanupTimeout = 2 * time.Second
)

// Errors NewS3 wraps, so that callers can choose exit codes and hints.
var (
	// ErrNoCredentials: no access key was configured, in the environment
	// or in the shared credentials file. S3 never falls back to anonymous
	// access.
	ErrNoCredentials = errors.New("no S3 credentials found")
	// ErrBadCredentials: the server refused the credentials.
	ErrBadCredentials = errors.New("credentials refused")
	// ErrNoSuchBucket: the bucket does not exist at the endpoint.
	ErrNoSuchBucket = errors.New("NoSuchBucket")
)

// PathStyle selects how the bucket is addressed: in the URL path
// (http://host/bucket/key, what MinIO and most S3-compatible servers want)
// or in the host name (http://bucket.host/key, AWS's default).
type PathStyle int

const (
	// PathStyleAuto lets minio-go decide from the endpoint (virtual host
	// style for AWS and a few known providers, path style for the rest).
	PathStyleAuto PathStyle = iota
	// PathStyleOn forces path-style addressing.
	PathStyleOn
	// PathStyleOff forces virtual-host-style addressing.
	PathStyleOff
)

// ParsePathStyle reads a flag or environment value: "" or "auto";
// "true", "on", "1" or "path"; "false", "off", "0" or "virtual".
func ParsePathStyle(s string) (PathStyle, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "auto":
		return PathStyleAuto, nil
	case "true", "on", "1", "yes", "path":
		return PathStyleOn, nil
	case "false", "off", "0", "no", "virtual", "virtual-host", "dns":
		return PathStyleOff, nil
	}
	return PathStyleAuto, fmt.Errorf("path style %q: want auto, path (true) or virtual (false)", s)
}

func (p PathStyle) String() string {
	switch p {
	case PathStyleOn:
		return "path"
	case PathStyleOff:
		return "virtual"
	}
	return "auto"
}

// S3Config says where an S3 store lives and how to talk to it. Only Bucket
// is required.
type S3Config struct {
	// Endpoint is host[:port] or a URL (http:// or https://, which then
	// decides Insecure). Empty: AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL,
	// then AWS S3 itself.
	Endpoint string
	Bucket   string
	// Prefix roots the store inside the bucket: object "a" is key
	// "Prefix/a". Leading and trailing slashes are ignored.
	Prefix string
	// Region: empty means AWS_REGION, then AWS_DEFAULT_REGION, then asking
	// the server.
	Region    string
	PathStyle PathStyle
	// Insecure uses plain http for an Endpoint given without a scheme.
	Insecure bool

	// AccessKey and SecretKey (and SessionToken for temporary
	// credentials) take precedence over the environment
	// (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN) and the
	// shared credentials file (AWS_SHARED_CREDENTIALS_FILE or
	// ~/.aws/credentials, AWS_CONFIG_FILE or ~/.aws/config).
	AccessKey    string
	SecretKey    string
	SessionToken string
	// Profile in the shared credentials file; empty: AWS_PROFILE, then
	// "default".
	Profile string

	// PartSize is the multipart part size (default 16 MiB, at least
	// 5 MiB). Objects smaller than this go up in a single PUT.
	PartSize int64
	// Parallel is the number of parts in flight per object (default 4). A
	// writer holds at most (Parallel+1)*PartSize bytes.
	Parallel int
	// MaxInflight is the number of parts in flight over all objects of
	// the store (default Parallel), so that objects written one after the
	// other, the last parts of one overlapping the first of the next, hold
	// no more than one would: at most (MaxInflight + open writers) *
	// PartSize bytes in all.
	MaxInflight int
	// MaxRetries is how often a request that failed in a way worth
	// retrying (network errors, 5xx, throttling) is retried, with
	// exponential backoff (default 6, about 12 s in all; negative: never;
	// a refused connection at most twice).
	MaxRetries int
	// ContentMD5 also sends Content-MD5 with every upload. CRC32C
	// (x-amz-checksum-crc32c) is always sent; some S3-compatible servers
	// and object-lock buckets want MD5 as well.
	ContentMD5 bool
}

// S3Store is a Store in an S3 bucket under a prefix. Writers upload explicit
// multipart uploads, completed on Commit, so that nothing is visible before
// Commit; readers issue ranged GETs and resume after connection failures.
type S3Store struct {
	core       *minio.Core
	transport  *http.Transport
	bucket     string
	root       string // "" or "prefix/"
	endpoint   string // scheme://host, for messages
	partSize   int64
	parallel   int
	maxRetries int
	md5        bool
	pieces     *streamer.BufferPool // of the parts being filled and uploaded
	uploaded   atomic.Int64
	inflight   chan struct{} // parts in flight over all writers
}

var crc32c = crc32.MakeTable(crc32.Castagnoli)

// NewS3 connects to the bucket, after checking that credentials were found,
// that the server accepts them and that the bucket exists. Errors never
// carry the secret key; they name the access key id, and wrap
// ErrNoCredentials, ErrBadCredentials or ErrNoSuchBucket where those apply.
//
// The environment fills in what cfg leaves empty: AWS_ENDPOINT_URL_S3 or
// AWS_ENDPOINT_URL (endpoint), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
// AWS_SESSION_TOKEN (credentials), else AWS_SHARED_CREDENTIALS_FILE,
// AWS_CONFIG_FILE and AWS_PROFILE (shared credentials file, ~/.aws by
// default), AWS_REGION or AWS_DEFAULT_REGION (region), AWS_CA_BUNDLE (extra
// CA certificates for https endpoints). ctx bounds the checks only.
func NewS3(ctx context.Context, cfg S3Config) (*S3Store, error) {
	if cfg.Bucket == "" {
		return nil, errors.New("s3: no bucket given")
	}
	host, secure, display, err := s3Endpoint(cfg)
	if err != nil {
		return nil, err
	}
	creds, keyID, err := s3Credentials(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("s3://%s at %s: %w", cfg.Bucket, display, err)
	}
	s := &S3Store{
		bucket:     cfg.Bucket,
		endpoint:   display,
		partSize:   cfg.PartSize,
		parallel:   cfg.Parallel,
		maxRetries: cfg.MaxRetries,
		md5:        cfg.ContentMD5,
	}
	if p := strings.Trim(cfg.Prefix, "/"); p != "" {
		s.root = p + "/"
	}
	if s.partSize == 0 {
		s.partSize = DefaultS3PartSize
	}
	if s.partSize < minS3PartSize || s.partSize > maxS3PartSize {
		return nil, fmt.Errorf("s3: part size %d is outside S3's limits (5 MiB to 5 GiB)", s.partSize)
	}
	if s.parallel <= 0 {
		s.parallel = DefaultS3Parallel
	}
	maxInflight := cfg.MaxInflight
	if maxInflight <= 0 {
		maxInflight = s.parallel
	}
	s.inflight = make(chan struct{}, maxInflight)
	// Keep the pieces of as many parts as are in use at once when an
	// archive is written: the parts in flight, and the part being filled
	// of the segment being written and of each segment committing.
	perPart := int((s.partSize + pieceSize - 1) / pieceSize)
	s.pieces = streamer.NewBufferPool(pieceSize, (maxInflight+1+streamer.DefaultCommitting)*perPart)
	switch {
	case s.maxRetries == 0:
		s.maxRetries = DefaultS3MaxRetries
	case s.maxRetries < 0:
		s.maxRetries = 0
	}
	region := cfg.Region
	if region == "" {
		region = os.Getenv("AWS_REGION")
	}
	if region == "" {
		region = os.Getenv("AWS_DEFAULT_REGION")
	}
	tr, err := minio.DefaultTransport(secure)
	if err != nil {
		return nil, fmt.Errorf("s3: transport: %w", err)
	}
	// Restores read many chunks in parallel; keep their connections.
	tr.MaxIdleConnsPerHost = 64
	if f := os.Getenv("AWS_CA_BUNDLE"); secure && f != "" {
		// A private CA for the endpoint, as the AWS tools take it.
		pem, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("s3: AWS_CA_BUNDLE: %w", err)
		}
		pool, err := x509.SystemCertPool()
		if err != nil {
			pool = x509.NewCertPool()
		}
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("s3: AWS_CA_BUNDLE %s holds no PEM certificates", f)
		}
		tr.TLSClientConfig.RootCAs = pool
	}
	s.transport = tr
	lookup := minio.BucketLookupAuto
	switch cfg.PathStyle {
	case PathStyleOn:
		lookup = minio.BucketLookupPath
	case PathStyleOff:
		lookup = minio.BucketLookupDNS
	}
	s.core, err = minio.NewCore(host, &minio.Options{
		Creds:        creds,
		Secure:       secure,
		Transport:    tr,
		Region:       region,
		BucketLookup: lookup,
		// Retries are ours (see retry): one attempt per call here.
		MaxRetries: 1,
	})
	if err != nil {
		return nil, fmt.Errorf("s3://%s at %s: %w", cfg.Bucket, display, err)
	}
	s.core.SetAppInfo("gpucr-stream", "1")
	if err := s.checkBucket(ctx, keyID); err != nil {
		tr.CloseIdleConnections()
		return nil, err
	}
	return s, nil
}

// s3Endpoint resolves the endpoint into minio-go's host[:port] and TLS
// choice, and a scheme://host form for messages.
func s3Endpoint(cfg S3Config) (host string, secure bool, display string, err error) {
	ep := cfg.Endpoint
	if ep == "" {
		ep = os.Getenv("AWS_ENDPOINT_URL_S3")
	}
	if ep == "" {
		ep = os.Getenv("AWS_ENDPOINT_URL")
	}
	if ep == "" {
		return "s3.amazonaws.com", true, "https://s3.amazonaws.com", nil
	}
	secure = !cfg.Insecure
	host = ep
	if strings.Contains(ep, "://") {
		u, err := url.Parse(ep)
		if err != nil {
			return "", false, "", fmt.Errorf("s3 endpoint %s: %w", Redact(ep), err)
		}
		switch u.Scheme {
		case "http":
			secure = false
		case "https":
			secure = true
		default:
			return "", false, "", fmt.Errorf("s3 endpoint %s: scheme must be http or https", Redact(ep))
		}
		if u.User != nil {
			return "", false, "", fmt.Errorf("s3 endpoint %s: credentials do not belong in the endpoint; use AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", Redact(ep))
		}
		if (u.Path != "" && u.Path != "/") || u.RawQuery != "" {
			return "", false, "", fmt.Errorf("s3 endpoint %s: want scheme://host[:port] without a path", Redact(ep))
		}
		host = u.Host
	}
	if host == "" || strings.ContainsAny(host, "/?#@") {
		return "", false, "", fmt.Errorf("s3 endpoint %q: want host[:port] or scheme://host[:port]", Redact(ep))
	}
	scheme := "https"
	if !secure {
		scheme = "http"
	}
	return host, secure, scheme + "://" + host, nil
}

// s3Credentials finds credentials: explicit ones, then the environment,
// then the shared credentials file. It fails rather than return anonymous
// credentials, and returns the access key id for messages.
func s3Credentials(ctx context.Context, cfg S3Config) (*credentials.Credentials, string, error) {
	if cfg.AccessKey != "" || cfg.SecretKey != "" {
		if cfg.AccessKey == "" || cfg.SecretKey == "" {
			return nil, "", fmt.Errorf("%w: an access key id and a secret key must both be given", ErrNoCredentials)
		}
		return credentials.NewStaticV4(cfg.AccessKey, cfg.SecretKey, cfg.SessionToken), cfg.AccessKey, nil
	}
	id, secret := os.Getenv("AWS_ACCESS_KEY_ID"), os.Getenv("AWS_SECRET_ACCESS_KEY")
	switch {
	case id != "" && secret != "":
		return credentials.NewStaticV4(id, secret, os.Getenv("AWS_SESSION_TOKEN")), id, nil
	case id != "":
		return nil, "", fmt.Errorf("%w: AWS_ACCESS_KEY_ID (%s) is set but AWS_SECRET_ACCESS_KEY is empty", ErrNoCredentials, id)
	case secret != "":
		return nil, "", fmt.Errorf("%w: AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is empty", ErrNoCredentials)
	}
	profile := cfg.Profile
	if profile == "" {
		profile = os.Getenv("AWS_PROFILE")
	}
	if profile == "" {
		profile = "default"
	}
	file := os.Getenv("AWS_SHARED_CREDENTIALS_FILE")
	if file == "" {
		file = "~/.aws/credentials"
	}
	// The file provider also understands SSO profiles and
	// credential_process, and refreshes what expires.
	fc := credentials.New(&credentials.FileAWSCredentials{Profile: cfg.Profile})
	v, err := fc.GetWithContext(&credentials.CredContext{Context: ctx, Client: http.DefaultClient})
	if err == nil && v.AccessKeyID != "" && v.SecretAccessKey != "" {
		return fc, v.AccessKeyID, nil
	}
	var why string
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		why = fmt.Sprintf(" (profile %q: %v)", profile, err)
	}
	return nil, "", fmt.Errorf("%w: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary credentials), "+
		"or give profile %q in the shared credentials file %s (AWS_SHARED_CREDENTIALS_FILE, AWS_PROFILE)%s; anonymous access is never used",
		ErrNoCredentials, profile, file, why)
}

// checkBucket makes one authenticated request so that bad credentials and
// a missing bucket are reported at start, clearly, and not as the first
// upload failing in the middle of a checkpoint.
func (s *S3Store) checkBucket(ctx context.Context, keyID string) error {
	var ok bool
	err := s.retry(ctx, func(ctx context.Context) error {
		var err error
		ok, err = s.core.BucketExists(ctx, s.bucket)
		return err
	})
	noBucket := fmt.Errorf("s3: bucket %s does not exist at %s (%w)", s.bucket, s.endpoint, ErrNoSuchBucket)
	if err == nil {
		if !ok {
			return noBucket
		}
		return nil
	}
	// HEAD answers carry no error body; a listing says why it was refused.
	if er := minio.ToErrorResponse(err); er.StatusCode == http.StatusForbidden || er.StatusCode == http.StatusBadRequest {
		lctx, cancel := context.WithCancel(ctx)
		for o := range s.core.Client.ListObjects(lctx, s.bucket, minio.ListObjectsOptions{MaxKeys: 1}) {
			if o.Err != nil {
				err = o.Err
			}
			break
		}
		cancel()
	}
	where := "s3://" + s.bucket + " at " + s.endpoint
	er := minio.ToErrorResponse(err)
	switch er.Code {
	case "NoSuchBucket":
		return noBucket
	case "InvalidAccessKeyId":
		return fmt.Errorf("%s: %w: the server does not know access key id %s (InvalidAccessKeyId)", where, ErrBadCredentials, keyID)
	case "SignatureDoesNotMatch":
		return fmt.Errorf("%s: %w: wrong secret key for access key id %s (SignatureDoesNotMatch)", where, ErrBadCredentials, keyID)
	case "ExpiredToken", "InvalidToken", "TokenRefreshRequired":
		return fmt.Errorf("%s: %w: the session token of access key id %s is expired or invalid (%s)", where, ErrBadCredentials, keyID, er.Code)
	case "AccessDenied", "AllAccessDisabled":
		return fmt.Errorf("%s: %w: access key id %s may not access the bucket (%s)", where, ErrBadCredentials, keyID, er.Code)
	}
	return fmt.Errorf("%s: checking the bucket with access key id %s: %w", where, keyID, err)
}

// String implements streamer.Store: s3://bucket/prefix, never credentials.
func (s *S3Store) String() string {
	if s.root == "" {
		return "s3://" + s.bucket
	}
	return "s3://" + s.bucket + "/" + strings.TrimSuffix(s.root, "/")
}

// Uploaded returns the bytes the server has acknowledged so far, over all
// objects (parts and small objects), for progress displays.
func (s *S3Store) Uploaded() int64 { return s.uploaded.Load() }

// PartSize is the multipart part size the store uploads with.
func (s *S3Store) PartSize() int64 { return s.partSize }

// Endpoint is the scheme://host the store talks to.
func (s *S3Store) Endpoint() string { return s.endpoint }

// Close releases idle connections. The store must not be used afterwards.
func (s *S3Store) Close() error {
	s.transport.CloseIdleConnections()
	return nil
}

func (s *S3Store) url(name string) string { return "s3://" + s.bucket + "/" + s.root + name }

func (s *S3Store) key(name string) (string, error) {
	if name == "" || strings.Contains(name, "..") || strings.HasPrefix(name, "/") || strings.ContainsRune(name, 0) {
		return "", fmt.Errorf("%s: invalid object name %q", s, name)
	}
	return s.root + name, nil
}

// retry runs fn until it succeeds, fails in a way not worth retrying, or
// maxRetries retries have failed, sleeping with jittered exponential
// backoff in between. fn must be able to start over: every upload keeps
// its bytes until it is acknowledged.
func (s *S3Store) retry(ctx context.Context, fn func(context.Context) error) error {
	for attempt := 0; ; attempt++ {
		err := fn(ctx)
		if err == nil {
			return nil
		}
		// The request's URL says nothing our messages do not (they name
		// the object) and carries upload ids; keep the cause.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		if ctx.Err() != nil || !retryable(err) {
			return err
		}
		if attempt >= s.maxRetries || (refused(err) && attempt >= refusedRetries) {
			if attempt > 0 {
				return fmt.Errorf("%w (gave up after %d attempts)", err, attempt+1)
			}
			return err
		}
		if serr := sleep(ctx, backoff(attempt)); serr != nil {
			return fmt.Errorf("%w (stopped retrying: %w)", err, serr)
		}
	}
}

// refusedRetries bounds the retries of a refused connection: nothing
// listens there, which a server that restarts fixes within a second or not
// for a long while; meanwhile a checkpoint holds its process frozen.
const refusedRetries = 2

func refused(err error) bool { return errors.Is(err, syscall.ECONNREFUSED) }

func backoff(attempt int) time.Duration {
	d := retryBase << min(attempt, 10)
	d = min(d, retryCap)
	// Full jitter on the upper half keeps parallel parts from retrying in
	// lockstep.
	return d/2 + rand.N(d/2+1)
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// retryable says whether a failed request is worth repeating: network
// failures, server errors and throttling are; refusals are not.
func retryable(err error) bool {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var er minio.ErrorResponse
	if !errors.As(err, &er) {
		// Connection refused or reset, a body cut short, a timeout.
		return true
	}
	switch er.Code {
	case "RequestTimeout", "SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeTooSkewed",
		"OperationAborted", "XMinioServerNotInitialized", "XMinioReadQuorum", "XMinioWriteQuorum",
		"XAmzContentSHA256Mismatch", "BadDigest", "XAmzContentChecksumMismatch", "IncompleteBody":
		// The last four: the bytes were damaged on the way; send them again.
		return true
	}
	switch er.StatusCode {
	case http.StatusRequestTimeout, http.StatusTooManyRequests, http.StatusInternalServerError,
		http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

func isNotExist(err error) bool {
	switch minio.ToErrorResponse(err).Code {
	case "NoSuchKey", "NoSuchObject":
		return true
	}
	return false
}

func checksums(pieces [][]byte, withMD5 bool) (crc, md5sum string) {
	var sum uint32
	for _, p := range pieces {
		sum = crc32.Update(sum, crc32c, p)
	}
	var c [4]byte
	binary.BigEndian.PutUint32(c[:], sum)
	crc = base64.StdEncoding.EncodeToString(c[:])
	if withMD5 {
		m := md5.New()
		for _, p := range pieces {
			m.Write(p)
		}
		md5sum = base64.StdEncoding.EncodeToString(m.Sum(nil))
	}
	return crc, md5sum
}

const (
	hdrChecksumAlgo   = "X-Amz-Checksum-Algorithm"
	hdrChecksumCRC32C = "X-Amz-Checksum-Crc32c"
)

// pieceSize is the unit in which parts are buffered. A part holds only
// as many pieces as it has bytes: the last part of a segment, a few MiB
// that wait for an upload slot while the next segment fills, does not pin
// a whole PartSize buffer. The pieces are reused part after part, segment
// after segment, so uploading makes no garbage.
const pieceSize = 1 << 20

// partBuf is a part being filled or uploaded: pieces, all full but the
// last.
type partBuf struct {
	pieces [][]byte
	n      int
}

// body reads the part from its start; each attempt of an upload takes a
// new one.
func (p *partBuf) body() io.Reader {
	b := net.Buffers(slices.Clone(p.pieces)) // reading consumes the slice
	return &b
}

// release gives the pieces back to the store's pool; the small first
// piece of a small object is left to the garbage collector.
func (p *partBuf) release(s *S3Store) {
	for _, b := range p.pieces {
		s.pieces.Put(b)
	}
	*p = partBuf{}
}

// Create implements streamer.Store. The writer buffers PartSize bytes,
// then uploads parts in the background, at most Parallel at once; ctx
// governs those uploads until Commit or Abort. Every writer must end with
// Commit or Abort, which wait for its uploads.
func (s *S3Store) Create(ctx context.Context, name string) (streamer.ObjectWriter, error) {
	key, err := s.key(name)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("create %s: %w", s.url(name), err)
	}
	uctx, cancel := context.WithCancelCause(ctx)
	return &s3Writer{s: s, name: name, key: key, ctx: uctx, cancel: cancel, sem: make(chan struct{}, s.parallel)}, nil
}

// s3Writer is one object being written. Write, Commit and Abort are called
// from one goroutine; part uploads run in goroutines the writer owns and
// waits for.
type s3Writer struct {
	s        *S3Store
	name     string
	key      string
	ctx      context.Context // part uploads; canceled on failure and by Abort
	cancel   context.CancelCauseFunc
	part     partBuf // being filled
	written  int64
	uploadID string // set once the first part goes out
	open     bool   // uploadID is neither completed nor aborted
	nparts   int
	sem      chan struct{} // a slot per part in flight
	wg       sync.WaitGroup
	finished bool // Commit or Abort was called

	mu    sync.Mutex
	err   error // first part failure
	parts []uploadedPart
}

type uploadedPart struct {
	minio.CompletePart
	size int64
}

var errFinished = errors.New("object already committed or aborted")

func (w *s3Writer) failure() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

func (w *s3Writer) fail(err error) {
	w.mu.Lock()
	if w.err == nil {
		w.err = err
		w.cancel(err)
	}
	w.mu.Unlock()
}

// Write buffers b, sending full parts off. After a part failed it returns
// that failure at once, so that the pipeline stops early.
func (w *s3Writer) Write(b []byte) (int, error) {
	if w.finished {
		return 0, fmt.Errorf("write %s: %w", w.s.url(w.name), errFinished)
	}
	if err := w.failure(); err != nil {
		return 0, err
	}
	n := 0
	ps := int(w.s.partSize)
	for len(b) > 0 {
		if w.part.n == ps {
			if err := w.sendPart(); err != nil {
				return n, err
			}
		}
		want := min(len(b), ps-w.part.n)
		last := w.room(want)
		k := copy(last[len(last):cap(last)], b[:want])
		w.part.pieces[len(w.part.pieces)-1] = last[:len(last)+k]
		w.part.n += k
		b = b[k:]
		n += k
		w.written += int64(k)
	}
	return n, nil
}

// room returns the part's last piece with room at its end, taking a new
// piece when it is full; n is how many bytes are coming (at most what the
// part has left).
func (w *s3Writer) room(n int) []byte {
	p := &w.part
	i := len(p.pieces) - 1
	if i >= 0 && len(p.pieces[i]) < cap(p.pieces[i]) {
		return p.pieces[i]
	}
	nb, ok := w.s.pieces.TryGet()
	if !ok {
		nb = w.newPiece(n)
	}
	if i == 0 && cap(p.pieces[0]) < pieceSize {
		// The small first piece is full: move it into the larger one.
		p.pieces[0] = append(nb[:0], p.pieces[0]...)
		return p.pieces[0]
	}
	p.pieces = append(p.pieces, nb[:0])
	return p.pieces[i+1]
}

// newPiece allocates a piece when the pool has none free. The first of an
// object starts small and grows by doubling, since objects other than
// segments (the manifest) are mostly small; the others are whole pieces.
func (w *s3Writer) newPiece(n int) []byte {
	if w.nparts == 0 && len(w.part.pieces) <= 1 {
		c := max(64<<10, n)
		if len(w.part.pieces) == 1 {
			c = max(c, 2*cap(w.part.pieces[0]))
		}
		if c < pieceSize {
			return make([]byte, c)
		}
	}
	return w.s.pieces.Get()
}

// sendPart hands the part to a new upload, waiting for a slot.
func (w *s3Writer) sendPart() error {
	if w.uploadID == "" {
		var id string
		err := w.s.retry(w.ctx, func(ctx context.Context) error {
			var err error
			id, err = w.s.core.NewMultipartUpload(ctx, w.s.bucket, w.key, minio.PutObjectOptions{
				UserMetadata: map[string]string{hdrChecksumAlgo: "CRC32C"},
			})
			return err
		})
		if err != nil {
			err = fmt.Errorf("start upload of %s: %w", w.s.url(w.name), err)
			w.fail(err)
			return err
		}
		w.uploadID, w.open = id, true
	}
	if w.nparts == maxS3Parts {
		err := fmt.Errorf("upload %s: more than %d parts of %d bytes; use a larger part size", w.s.url(w.name), maxS3Parts, w.s.partSize)
		w.fail(err)
		return err
	}
	select {
	case w.sem <- struct{}{}:
	case <-w.ctx.Done():
		if err := w.failure(); err != nil {
			return err
		}
		return fmt.Errorf("upload %s: %w", w.s.url(w.name), context.Cause(w.ctx))
	}
	// And a slot of the store's: segments that finish committing in the
	// background share it with the one being written.
	select {
	case w.s.inflight <- struct{}{}:
	case <-w.ctx.Done():
		<-w.sem
		if err := w.failure(); err != nil {
			return err
		}
		return fmt.Errorf("upload %s: %w", w.s.url(w.name), context.Cause(w.ctx))
	}
	w.nparts++
	data := w.part
	w.part = partBuf{} // the next part takes pieces as its bytes come
	w.wg.Add(1)
	go w.uploadPart(w.nparts, data)
	return nil
}

func (w *s3Writer) uploadPart(num int, data partBuf) {
	defer w.wg.Done()
	defer func() { <-w.sem; <-w.s.inflight }()
	defer data.release(w.s)
	crc, md5sum := checksums(data.pieces, w.s.md5)
	var part minio.ObjectPart
	err := w.s.retry(w.ctx, func(ctx context.Context) error {
		hdr := http.Header{}
		hdr.Set(hdrChecksumCRC32C, crc)
		var err error
		part, err = w.s.core.PutObjectPart(ctx, w.s.bucket, w.key, w.uploadID, num, data.body(), int64(data.n),
			minio.PutObjectPartOptions{Md5Base64: md5sum, CustomHeader: hdr, DisableContentSha256: true})
		return err
	})
	if err == nil && part.ChecksumCRC32C != "" && part.ChecksumCRC32C != crc {
		err = fmt.Errorf("server stored CRC32C %s, sent %s", part.ChecksumCRC32C, crc)
	}
	if err != nil {
		w.fail(fmt.Errorf("upload part %d (%d bytes) of %s: %w", num, data.n, w.s.url(w.name), err))
		return
	}
	w.s.uploaded.Add(int64(data.n))
	w.mu.Lock()
	w.parts = append(w.parts, uploadedPart{
		CompletePart: minio.CompletePart{PartNumber: num, ETag: part.ETag, ChecksumCRC32C: crc},
		size:         int64(data.n),
	})
	w.mu.Unlock()
}

// Commit implements streamer.ObjectWriter: it waits for every part,
// checks that the parts hold exactly the bytes written, and completes the
// upload (or PUTs a small object whole). On failure the upload is aborted.
func (w *s3Writer) Commit(ctx context.Context) (err error) {
	if w.finished {
		return fmt.Errorf("commit %s: %w", w.s.url(w.name), errFinished)
	}
	w.finished = true
	stop := context.AfterFunc(ctx, func() { w.cancel(context.Cause(ctx)) })
	defer stop()
	defer func() {
		w.part.release(w.s)
		defer w.cancel(errFinished) // release the upload context
		if err != nil {
			// Clean up even when ctx is what failed, but briefly: against
			// a server that is down the abort cannot succeed, and the
			// caller should hear of the failure now. An upload left
			// behind is invisible; gc (RemoveIncomplete) removes it.
			actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitCleanupTimeout)
			_ = w.abort(actx)
			cancel()
			err = fmt.Errorf("commit %s: %w", w.s.url(w.name), err)
		}
	}()
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := w.failure(); err != nil {
		return err
	}
	if w.ctx.Err() != nil {
		// Create's context ended: the caller gave up on this object.
		return fmt.Errorf("upload canceled: %w", context.Cause(w.ctx))
	}
	if w.uploadID == "" {
		return w.putSmall(ctx)
	}
	if w.part.n > 0 {
		if err := w.sendPart(); err != nil {
			return err
		}
	}
	w.wg.Wait()
	if err := w.failure(); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	sort.Slice(w.parts, func(i, j int) bool { return w.parts[i].PartNumber < w.parts[j].PartNumber })
	var total int64
	complete := make([]minio.CompletePart, len(w.parts))
	for i, p := range w.parts {
		if p.PartNumber != i+1 {
			return fmt.Errorf("part %d is missing", i+1)
		}
		total += p.size
		complete[i] = p.CompletePart
	}
	if total != w.written || len(w.parts) != w.nparts {
		return fmt.Errorf("%d bytes written but %d parts hold %d bytes; not completing", w.written, len(w.parts), total)
	}
	attempt := 0
	err = w.s.retry(ctx, func(ctx context.Context) error {
		attempt++
		_, err := w.s.core.CompleteMultipartUpload(ctx, w.s.bucket, w.key, w.uploadID, complete, minio.PutObjectOptions{})
		if err != nil && attempt > 1 && minio.ToErrorResponse(err).Code == "NoSuchUpload" {
			// An earlier attempt may have completed it and lost the answer;
			// the size check below decides.
			return nil
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("complete upload: %w", err)
	}
	w.open = false
	return w.checkSize(ctx)
}

// putSmall uploads an object smaller than a part in one request.
func (w *s3Writer) putSmall(ctx context.Context) error {
	data := &w.part
	crc, md5sum := checksums(data.pieces, w.s.md5)
	err := w.s.retry(ctx, func(ctx context.Context) error {
		_, err := w.s.core.PutObject(ctx, w.s.bucket, w.key, data.body(), int64(data.n), md5sum, "",
			minio.PutObjectOptions{UserMetadata: map[string]string{hdrChecksumCRC32C: crc}, DisableContentSha256: true})
		return err
	})
	if err != nil {
		return fmt.Errorf("put: %w", err)
	}
	w.s.uploaded.Add(int64(data.n))
	return w.checkSize(ctx)
}

// checkSize confirms what the server now holds; an object of the wrong
// size is deleted again rather than left looking complete.
func (w *s3Writer) checkSize(ctx context.Context) error {
	var info minio.ObjectInfo
	err := w.s.retry(ctx, func(ctx context.Context) error {
		var err error
		info, err = w.s.core.StatObject(ctx, w.s.bucket, w.key, minio.StatObjectOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("stat after upload: %w", err)
	}
	if info.Size != w.written {
		_ = w.s.retry(ctx, func(ctx context.Context) error {
			return w.s.core.RemoveObject(ctx, w.s.bucket, w.key, minio.RemoveObjectOptions{})
		})
		return fmt.Errorf("%d bytes written but the server holds %d; object removed", w.written, info.Size)
	}
	return nil
}

// Abort implements streamer.ObjectWriter: it stops the part uploads and
// aborts the multipart upload so that no parts are left behind. It is safe
// after Commit failed, and retries an abort that failed then.
func (w *s3Writer) Abort(ctx context.Context) error {
	if !w.finished {
		w.finished = true
		w.part.release(w.s)
	}
	if err := w.abort(ctx); err != nil {
		return fmt.Errorf("abort %s: %w", w.s.url(w.name), err)
	}
	return nil
}

func (w *s3Writer) abort(ctx context.Context) error {
	w.cancel(errAborted)
	w.wg.Wait()
	if !w.open {
		return nil
	}
	err := w.s.retry(ctx, func(ctx context.Context) error {
		err := w.s.core.AbortMultipartUpload(ctx, w.s.bucket, w.key, w.uploadID)
		if minio.ToErrorResponse(err).Code == "NoSuchUpload" {
			return nil
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("abort upload %s: %w", w.uploadID, err)
	}
	w.open = false
	return nil
}

var errAborted = errors.New("upload aborted")

// Open implements streamer.Store with a ranged GET. The bytes of
// [off, off+length) that exist are returned: a range past the end reads
// short, and reads nothing from off >= size. A connection that fails in
// the middle is resumed where it stopped, if the object has not changed.
func (s *S3Store) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
	key, err := s.key(name)
	if err != nil {
		return nil, err
	}
	if off < 0 {
		return nil, fmt.Errorf("open %s: negative offset %d", s.url(name), off)
	}
	if length == 0 {
		if _, err := s.Stat(ctx, name); err != nil {
			return nil, err
		}
		return io.NopCloser(bytes.NewReader(nil)), nil
	}
	end := int64(-1) // unknown until the answer
	if length > 0 {
		end = off + length
	}
	r := &s3Reader{s: s, ctx: ctx, name: name, key: key, pos: off, end: end}
	if err := r.get(); err != nil {
		if isNotExist(err) {
			return nil, fmt.Errorf("open %s: %w: %w", s.url(name), errdefs.ErrNotFound, err)
		}
		if minio.ToErrorResponse(err).Code == "InvalidRange" {
			// off is at or past the end of an object that exists.
			return io.NopCloser(bytes.NewReader(nil)), nil
		}
		return nil, fmt.Errorf("open %s at %d: %w", s.url(name), off, err)
	}
	return r, nil
}

// s3Reader reads a range of one object, resuming after connection
// failures from where it got to, on the same version of the object.
type s3Reader struct {
	s       *S3Store
	ctx     context.Context
	name    string
	key     string
	body    io.ReadCloser
	pos     int64 // next byte to read
	end     int64 // end of the range, exclusive
	etag    string
	resumes int
	// unsized: the server sent no length, so end is unknown and the
	// first clean EOF ends the range.
	unsized bool
}

func (r *s3Reader) get() error {
	opts := minio.GetObjectOptions{}
	if r.end > 0 {
		if err := opts.SetRange(r.pos, r.end-1); err != nil {
			return err
		}
	} else if r.pos > 0 {
		if err := opts.SetRange(r.pos, 0); err != nil {
			return err
		}
	}
	if r.etag != "" {
		if err := opts.SetMatchETag(r.etag); err != nil {
			return err
		}
	}
	return r.s.retry(r.ctx, func(ctx context.Context) error {
		body, info, _, err := r.s.core.GetObject(ctx, r.s.bucket, r.key, opts)
		if err != nil {
			return err
		}
		r.body = body
		r.etag = info.ETag
		if info.Size >= 0 {
			// The answer's length is what exists of the range.
			r.end = r.pos + info.Size
		} else if r.end < 0 {
			r.end, r.unsized = math.MaxInt64, true
		}
		return nil
	})
}

func (r *s3Reader) Read(p []byte) (int, error) {
	for {
		if r.pos >= r.end {
			return 0, io.EOF
		}
		if r.body == nil {
			return 0, fmt.Errorf("read %s: reader closed", r.s.url(r.name))
		}
		if int64(len(p)) > r.end-r.pos {
			p = p[:r.end-r.pos]
		}
		n, err := r.body.Read(p)
		r.pos += int64(n)
		if err == io.EOF && r.pos < r.end {
			if r.unsized {
				r.end = r.pos
				return n, io.EOF
			}
			err = io.ErrUnexpectedEOF
		}
		if err == nil || err == io.EOF {
			return n, err
		}
		// The connection failed in the middle of the range.
		if r.ctx.Err() != nil || !retryable(err) || r.resumes >= r.s.maxRetries {
			return n, fmt.Errorf("read %s at %d: %w", r.s.url(r.name), r.pos, err)
		}
		r.resumes++
		r.body.Close()
		r.body = nil
		if serr := sleep(r.ctx, backoff(r.resumes-1)); serr != nil {
			return n, fmt.Errorf("read %s at %d: %w", r.s.url(r.name), r.pos, err)
		}
		if gerr := r.get(); gerr != nil {
			return n, fmt.Errorf("read %s at %d: %w; resuming: %w", r.s.url(r.name), r.pos, err, gerr)
		}
		if n > 0 {
			return n, nil
		}
	}
}

func (r *s3Reader) Close() error {
	if r.body == nil {
		return nil
	}
	err := r.body.Close()
	r.body = nil
	return err
}

// Stat implements streamer.Store.
func (s *S3Store) Stat(ctx context.Context, name string) (streamer.ObjectInfo, error) {
	key, err := s.key(name)
	if err != nil {
		return streamer.ObjectInfo{}, err
	}
	var info minio.ObjectInfo
	err = s.retry(ctx, func(ctx context.Context) error {
		var err error
		info, err = s.core.StatObject(ctx, s.bucket, key, minio.StatObjectOptions{})
		return err
	})
	if err != nil {
		if isNotExist(err) {
			return streamer.ObjectInfo{}, fmt.Errorf("stat %s: %w: %w", s.url(name), errdefs.ErrNotFound, err)
		}
		return streamer.ObjectInfo{}, fmt.Errorf("stat %s: %w", s.url(name), err)
	}
	return streamer.ObjectInfo{Name: name, Size: info.Size, Modified: info.LastModified}, nil
}

// List implements streamer.Store: every object under the store's prefix
// whose name starts with prefix, names relative to the store, sorted.
// Unfinished uploads are not objects and are not listed.
func (s *S3Store) List(ctx context.Context, prefix string) ([]streamer.ObjectInfo, error) {
	var out []streamer.ObjectInfo
	err := s.retry(ctx, func(ctx context.Context) error {
		out = out[:0]
		lctx, cancel := context.WithCancel(ctx)
		defer cancel() // stops minio-go's listing goroutine if we return early
		for o := range s.core.Client.ListObjects(lctx, s.bucket, minio.ListObjectsOptions{Prefix: s.root + prefix, Recursive: true}) {
			if o.Err != nil {
				return o.Err
			}
			if strings.HasSuffix(o.Key, "/") || !strings.HasPrefix(o.Key, s.root) {
				continue // folder markers some tools create
			}
			out = append(out, streamer.ObjectInfo{Name: o.Key[len(s.root):], Size: o.Size, Modified: o.LastModified})
		}
		// A canceled listing ends without an error of its own.
		return ctx.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", s.url(prefix), err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// Delete implements streamer.Store.
func (s *S3Store) Delete(ctx context.Context, name string) error {
	key, err := s.key(name)
	if err != nil {
		return err
	}
	err = s.retry(ctx, func(ctx context.Context) error {
		err := s.core.RemoveObject(ctx, s.bucket, key, minio.RemoveObjectOptions{})
		if isNotExist(err) {
			return nil
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("delete %s: %w", s.url(name), err)
	}
	return nil
}

// RemoveIncomplete aborts multipart uploads under prefix that were started
// more than olderThan ago: what a writer leaves behind when its process was
// killed, or when the server was unreachable as it aborted. They are
// invisible to List and Stat but take space until removed (or until a
// bucket lifecycle rule removes them). Returns how many were removed.
func (s *S3Store) RemoveIncomplete(ctx context.Context, prefix string, olderThan time.Duration) (int, error) {
	type upload struct{ key, id string }
	var todo []upload
	cutoff := time.Now().Add(-olderThan)
	full := s.root + prefix
	list := func(ctx context.Context, listPrefix string) error {
		todo = todo[:0]
		lctx, cancel := context.WithCancel(ctx)
		defer cancel()
		for u := range s.core.Client.ListIncompleteUploads(lctx, s.bucket, listPrefix, true) {
			if u.Err != nil {
				return u.Err
			}
			if strings.HasPrefix(u.Key, full) && u.Initiated.Before(cutoff) {
				todo = append(todo, upload{u.Key, u.UploadID})
			}
		}
		return ctx.Err()
	}
	err := s.retry(ctx, func(ctx context.Context) error { return list(ctx, full) })
	if err == nil && len(todo) == 0 && full != "" {
		// MinIO lists uploads only for an exact key or the whole bucket.
		err = s.retry(ctx, func(ctx context.Context) error { return list(ctx, "") })
	}
	if err != nil {
		return 0, fmt.Errorf("list incomplete uploads in %s: %w", s.url(prefix), err)
	}
	for i, u := range todo {
		err := s.retry(ctx, func(ctx context.Context) error {
			err := s.core.AbortMultipartUpload(ctx, s.bucket, u.key, u.id)
			if minio.ToErrorResponse(err).Code == "NoSuchUpload" {
				return nil
			}
			return err
		})
		if err != nil {
			return i, fmt.Errorf("abort incomplete upload of s3://%s/%s: %w", s.bucket, u.key, err)
		}
	}
	return len(todo), nil
}
