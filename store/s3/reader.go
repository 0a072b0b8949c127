package s3

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math"

	"github.com/minio/minio-go/v7"

	"github.com/gpucr/gpucr-stream/errdefs"
)

// Open implements store.Store with a ranged GET. The bytes of
// [off, off+length) that exist are returned: a range past the end reads
// short, and reads nothing from off >= size. A connection that fails in
// the middle is resumed where it stopped, if the object has not changed.
func (s *Store) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
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
	s       *Store
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
	opts := minio.GetObjectOptions{ServerSideEncryption: readSSE(r.s.sse)}
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
