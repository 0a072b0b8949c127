package s3

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/redact"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// S3 limits and defaults.
const (
	// DefaultPartSize is the multipart part size: large enough that
	// per-request overhead does not matter, small enough that a handful in
	// flight fit in a modest memory budget. minio-go's own default for
	// streams of unknown length is about 537 MiB per part, per thread.
	DefaultPartSize = 16 << 20
	// DefaultParallel is the number of parts in flight per object.
	DefaultParallel = 4
	// DefaultMaxRetries is how often a failed request is retried.
	DefaultMaxRetries = 6

	minS3PartSize = 5 << 20 // S3's minimum for every part but the last
	maxS3PartSize = 5 << 30
	maxS3Parts    = 10000

	retryBase = 250 * time.Millisecond
	retryCap  = 8 * time.Second

	// commitCleanupTimeout bounds the abort of an upload whose commit
	// failed.
	commitCleanupTimeout = 2 * time.Second

	// archiveCommitting is how many segments an archive being written
	// commits in the background at most (streamer.DefaultCommitting), each
	// with a part of its own: the pool keeps their pieces too.
	archiveCommitting = 2
)

// Errors New wraps, so that callers can choose exit codes and hints.
var (
	// ErrNoCredentials: no access key was configured, in the environment
	// or in the shared credentials file. S3 never falls back to anonymous
	// access.
	ErrNoCredentials = errors.New("no S3 credentials found")
	// ErrBadCredentials: the server refused the credentials.
	ErrBadCredentials = errors.New("credentials refused")
	// ErrNoSuchBucket: the bucket does not exist at the endpoint; a kind
	// of errdefs.ErrNotFound.
	ErrNoSuchBucket = fmt.Errorf("NoSuchBucket: %w", errdefs.ErrNotFound)
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

// Config says where an S3 store lives and how to talk to it. Only Bucket
// is required.
type Config struct {
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
	// CreateBucket creates the bucket when it does not exist (in Region);
	// without it a missing bucket is ErrNoSuchBucket.
	CreateBucket bool
	// Insecure uses plain http for an Endpoint given without a scheme.
	Insecure bool
	// Warn receives warnings (a plain http endpoint, once per endpoint
	// and process); nil writes them to stderr.
	Warn func(msg string)

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
	// SSE asks the server to encrypt every object it stores (sse.go).
	SSE SSE
	// ContentMD5 also sends Content-MD5 with every upload. CRC32C
	// (x-amz-checksum-crc32c) is always sent; some S3-compatible servers
	// and object-lock buckets want MD5 as well.
	ContentMD5 bool
}

// s3Endpoint resolves the endpoint into minio-go's host[:port] and TLS
// choice, and a scheme://host form for messages.
func s3Endpoint(cfg Config) (host string, secure bool, display string, err error) {
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
			return "", false, "", fmt.Errorf("s3 endpoint %s: %w", redact.URL(ep), redact.Error(err))
		}
		switch u.Scheme {
		case "http":
			secure = false
		case "https":
			secure = true
		default:
			return "", false, "", fmt.Errorf("s3 endpoint %s: scheme must be http or https", redact.URL(ep))
		}
		if u.User != nil {
			return "", false, "", fmt.Errorf("s3 endpoint %s: credentials do not belong in the endpoint; use AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", redact.URL(ep))
		}
		if (u.Path != "" && u.Path != "/") || u.RawQuery != "" {
			return "", false, "", fmt.Errorf("s3 endpoint %s: want scheme://host[:port] without a path", redact.URL(ep))
		}
		host = u.Host
	}
	if strings.Contains(host, "@") {
		return "", false, "", fmt.Errorf("s3 endpoint %s: credentials do not belong in the endpoint; use AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", redact.URL(ep))
	}
	if host == "" || strings.ContainsAny(host, "/?#") {
		return "", false, "", fmt.Errorf("s3 endpoint %s: want host[:port] or scheme://host[:port]", redact.URL(ep))
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
func s3Credentials(ctx context.Context, cfg Config) (*credentials.Credentials, string, error) {
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
