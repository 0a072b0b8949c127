package s3

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"syscall"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/gpucr/gpucr-stream/errdefs"
)

// retry runs fn until it succeeds, fails in a way not worth retrying, or
// maxRetries retries have failed, sleeping with jittered exponential
// backoff in between. fn must be able to start over: every upload keeps
// its bytes until it is acknowledged.
func (s *Store) retry(ctx context.Context, fn func(context.Context) error) error {
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
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, errdefs.ErrExists) {
		return false
	}
	// An unknown host stays unknown: nothing to wait for.
	var dns *net.DNSError
	if errors.As(err, &dns) && dns.IsNotFound {
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
	case "ConditionalRequestConflict":
		// AWS: a conditional write (CommitNew) met a concurrent request on
		// the key; asked again, it is decided.
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
