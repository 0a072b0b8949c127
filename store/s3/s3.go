// Package s3 is a store.Store in an S3 bucket (AWS or any S3-compatible
// server, MinIO included) through minio-go: segments upload as multipart
// uploads in bounded pieces while CRIU dumps, reads are ranged GETs that
// resume after connection failures, and a refused or failing server is
// retried only as long as a frozen process can afford.
package s3

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"hash/crc32"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/encrypt"

	"github.com/gpucr/gpucr-stream/bufpool"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/store"
)

// Store is a store.Store in an S3 bucket under a prefix. Writers upload explicit
// multipart uploads, completed on Commit, so that nothing is visible before
// Commit; readers issue ranged GETs and resume after connection failures.
type Store struct {
	core       *minio.Core
	sse        encrypt.ServerSide // nil: none asked for
	transport  *http.Transport
	bucket     string
	root       string // "" or "prefix/"
	endpoint   string // scheme://host, for messages
	partSize   int64
	parallel   int
	maxRetries int
	md5        bool
	pieces     *bufpool.Pool // of the parts being filled and uploaded
	uploaded   *atomic.Int64 // shared with Parent's store
	inflight   chan struct{} // parts in flight over all writers
}

var crc32c = crc32.MakeTable(crc32.Castagnoli)

// New connects to the bucket, after checking that credentials were found,
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
func New(ctx context.Context, cfg Config) (*Store, error) {
	if cfg.Bucket == "" {
		return nil, errors.New("s3: no bucket given")
	}
	host, secure, display, err := s3Endpoint(cfg)
	if err != nil {
		return nil, err
	}
	if !secure {
		warnPlain(cfg.Warn, display)
	}
	creds, keyID, err := s3Credentials(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("s3://%s at %s: %w", cfg.Bucket, display, err)
	}
	s, err := sized(cfg, display)
	if err != nil {
		return nil, err
	}
	if s.sse, err = cfg.SSE.serverSide(secure); err != nil {
		return nil, fmt.Errorf("s3://%s at %s: %w", cfg.Bucket, display, err)
	}
	tr, err := s3Transport(secure)
	if err != nil {
		return nil, err
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
		Region:       s3Region(cfg),
		BucketLookup: lookup,
		// Retries are ours (see retry): one attempt per call here.
		MaxRetries: 1,
	})
	if err != nil {
		return nil, fmt.Errorf("s3://%s at %s: %w", cfg.Bucket, display, err)
	}
	s.core.SetAppInfo("gpucr-stream", "1")
	err = s.checkBucket(ctx, keyID)
	if errors.Is(err, ErrNoSuchBucket) && cfg.CreateBucket {
		err = s.retry(ctx, func(ctx context.Context) error {
			return s.core.MakeBucket(ctx, s.bucket, minio.MakeBucketOptions{Region: s3Region(cfg)})
		})
		if err != nil {
			err = fmt.Errorf("s3: create bucket %s at %s: %w", s.bucket, s.endpoint, err)
		}
	}
	if err != nil {
		tr.CloseIdleConnections()
		return nil, err
	}
	return s, nil
}

// sized is a Store with cfg's sizes and limits, defaults filled in, and no
// connection yet.
func sized(cfg Config, display string) (*Store, error) {
	s := &Store{
		uploaded:   new(atomic.Int64),
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
		s.partSize = DefaultPartSize
	}
	if s.partSize < minS3PartSize || s.partSize > maxS3PartSize {
		return nil, fmt.Errorf("s3: part size %d is outside S3's limits (5 MiB to 5 GiB)", s.partSize)
	}
	if s.parallel <= 0 {
		s.parallel = DefaultParallel
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
	s.pieces = bufpool.New(pieceSize, (maxInflight+1+archiveCommitting)*perPart)
	switch {
	case s.maxRetries == 0:
		s.maxRetries = DefaultMaxRetries
	case s.maxRetries < 0:
		s.maxRetries = 0
	}
	return s, nil
}

// s3Region is cfg's region, else the environment's.
func s3Region(cfg Config) string {
	if cfg.Region != "" {
		return cfg.Region
	}
	if r := os.Getenv("AWS_REGION"); r != "" {
		return r
	}
	return os.Getenv("AWS_DEFAULT_REGION")
}

// s3Transport is the HTTP transport of a store: minio's, keeping more idle
// connections, trusting AWS_CA_BUNDLE's CAs too for https.
func s3Transport(secure bool) (*http.Transport, error) {
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
	return tr, nil
}

// checkBucket makes one authenticated request so that bad credentials and
// a missing bucket are reported at start, clearly, and not as the first
// upload failing in the middle of a checkpoint.
func (s *Store) checkBucket(ctx context.Context, keyID string) error {
	var ok bool
	err := s.retry(ctx, func(ctx context.Context) error {
		var err error
		ok, err = s.core.BucketExists(ctx, s.bucket)
		return err
	})
	noBucket := fmt.Errorf("s3://%s: no such bucket at %s (%w)", s.bucket, s.endpoint, ErrNoSuchBucket)
	if err == nil {
		if !ok {
			return noBucket
		}
		return nil
	}
	// HEAD answers carry no error body; a listing says why it was refused.
	if er := minio.ToErrorResponse(err); er.StatusCode == http.StatusForbidden || er.StatusCode == http.StatusBadRequest {
		lctx, cancel := context.WithCancel(ctx)
		if o, ok := <-s.core.Client.ListObjects(lctx, s.bucket, minio.ListObjectsOptions{MaxKeys: 1}); ok && o.Err != nil {
			err = o.Err
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

// String implements store.Store: s3://bucket/prefix, never credentials.
func (s *Store) String() string {
	if s.root == "" {
		return "s3://" + s.bucket
	}
	return "s3://" + s.bucket + "/" + strings.TrimSuffix(s.root, "/")
}

// Parent is the store of the prefix that holds this one's, sharing its
// connection and limits, and this one's name in it; ok is false at the
// bucket's root. A checkpoint's location holds the chunk store its
// deduplicated chunks go to.
func (s *Store) Parent() (parent store.Store, name string, ok bool) {
	root := strings.TrimSuffix(s.root, "/")
	if root == "" {
		return nil, "", false
	}
	p := *s
	p.root = ""
	if i := strings.LastIndex(root, "/"); i >= 0 {
		p.root, root = root[:i+1], root[i+1:]
	}
	return &p, root, true
}

// Uploaded returns the bytes the server has acknowledged so far, over all
// objects (parts and small objects), for progress displays.
func (s *Store) Uploaded() int64 { return s.uploaded.Load() }

// PartSize is the multipart part size the store uploads with.
func (s *Store) PartSize() int64 { return s.partSize }

// Endpoint is the scheme://host the store talks to.
func (s *Store) Endpoint() string { return s.endpoint }

// Close releases idle connections. The store must not be used afterwards.
func (s *Store) Close() error {
	s.transport.CloseIdleConnections()
	return nil
}

func (s *Store) url(name string) string { return "s3://" + s.bucket + "/" + s.root + name }

func (s *Store) key(name string) (string, error) {
	if err := store.CheckName(name); err != nil {
		return "", fmt.Errorf("%s: %w", s, err)
	}
	return s.root + name, nil
}

// Stat implements store.Store.
func (s *Store) Stat(ctx context.Context, name string) (store.ObjectInfo, error) {
	key, err := s.key(name)
	if err != nil {
		return store.ObjectInfo{}, err
	}
	var info minio.ObjectInfo
	err = s.retry(ctx, func(ctx context.Context) error {
		var err error
		info, err = s.core.StatObject(ctx, s.bucket, key, statOptions(s.sse))
		return err
	})
	if err != nil {
		if isNotExist(err) {
			return store.ObjectInfo{}, fmt.Errorf("stat %s: %w: %w", s.url(name), errdefs.ErrNotFound, err)
		}
		return store.ObjectInfo{}, fmt.Errorf("stat %s: %w", s.url(name), err)
	}
	return store.ObjectInfo{Name: name, Size: info.Size, Modified: info.LastModified}, nil
}

// List implements store.Store: every object under the store's prefix
// whose name starts with prefix, names relative to the store, sorted.
// Unfinished uploads are not objects and are not listed.
func (s *Store) List(ctx context.Context, prefix string) ([]store.ObjectInfo, error) {
	var out []store.ObjectInfo
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
			out = append(out, store.ObjectInfo{Name: o.Key[len(s.root):], Size: o.Size, Modified: o.LastModified})
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

// Delete implements store.Store.
func (s *Store) Delete(ctx context.Context, name string) error {
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
// before cutoff (a time by the server's clock): what a writer leaves
// behind when its process was killed, or when the server was unreachable
// as it aborted. They are invisible to List and Stat but take space until
// removed (or until a bucket lifecycle rule removes them). Only uploads of
// objects ours recognises (by their name under the store's prefix) are
// aborted: the bucket may hold other programs' uploads, and uploads of
// writers in flight. Returns how many were removed.
func (s *Store) RemoveIncomplete(ctx context.Context, prefix string, cutoff time.Time, ours func(name string) bool) (int, error) {
	type upload struct{ key, id string }
	var todo []upload
	full := s.root + prefix
	list := func(ctx context.Context, listPrefix string) error {
		todo = todo[:0]
		lctx, cancel := context.WithCancel(ctx)
		defer cancel()
		for u := range s.core.Client.ListIncompleteUploads(lctx, s.bucket, listPrefix, true) {
			if u.Err != nil {
				return u.Err
			}
			if strings.HasPrefix(u.Key, full) && u.Initiated.Before(cutoff) && ours(strings.TrimPrefix(u.Key, s.root)) {
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

// plainWarned holds the plain-http endpoints warned about in this process.
var plainWarned sync.Map

// warnPlain says once per endpoint that it carries checkpoints in clear.
func warnPlain(warn func(string), display string) {
	if _, done := plainWarned.LoadOrStore(display, true); done {
		return
	}
	msg := fmt.Sprintf("warning: %s is plain http: checkpoints (process memory, secrets included) cross the network unencrypted; use https", display)
	if warn == nil {
		fmt.Fprintf(os.Stderr, "gpucr-stream: %s\n", msg)
		return
	}
	warn(msg)
}
