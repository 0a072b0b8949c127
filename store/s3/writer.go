package s3

import (
	"context"
	"crypto/md5"
	crand "crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"net/http"
	"slices"
	"sort"
	"sync"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/minio/minio-go/v7"
)

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
func (p *partBuf) release(s *Store) {
	for _, b := range p.pieces {
		s.pieces.Put(b)
	}
	*p = partBuf{}
}

// Create implements store.Store. The writer buffers PartSize bytes,
// then uploads parts in the background, at most Parallel at once; ctx
// governs those uploads until Commit or Abort. Every writer must end with
// Commit or Abort, which wait for its uploads.
func (s *Store) Create(ctx context.Context, name string) (store.ObjectWriter, error) {
	key, err := s.key(name)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("create %s: %w", s.url(name), err)
	}
	uctx, cancel := context.WithCancelCause(ctx)
	var token [16]byte
	crand.Read(token[:])
	return &s3Writer{s: s, name: name, key: key, ctx: uctx, cancel: cancel, sem: make(chan struct{}, s.parallel),
		token: hex.EncodeToString(token[:])}, nil
}

// s3Writer is one object being written. Write, Commit and Abort are called
// from one goroutine; part uploads run in goroutines the writer owns and
// waits for.
type s3Writer struct {
	s        *Store
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
	// token marks the object as this writer's (metaWriter), so that a
	// conditional commit that failed as "exists" after a retry can tell its
	// own earlier attempt, which succeeded unheard, from another writer's.
	token     string
	exclusive bool // CommitNew: If-None-Match: *

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
				UserMetadata:         map[string]string{hdrChecksumAlgo: "CRC32C", metaWriter: w.token},
				ServerSideEncryption: w.s.sse,
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
			minio.PutObjectPartOptions{Md5Base64: md5sum, CustomHeader: hdr, DisableContentSha256: true, SSE: partSSE(w.s.sse)})
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

// metaWriter is the user metadata that holds a writer's token.
const metaWriter = "Gpucr-Writer"

// Commit implements store.ObjectWriter: it waits for every part,
// checks that the parts hold exactly the bytes written, and completes the
// upload (or PUTs a small object whole). On failure the upload is aborted.
func (w *s3Writer) Commit(ctx context.Context) error { return w.commit(ctx, false) }

// CommitNew implements store.ObjectWriter with a conditional request,
// If-None-Match: * on the PUT or on CompleteMultipartUpload, which the
// server decides atomically (S3 since 2024, MinIO); a server that ignores
// the condition would make it a plain Commit, which the conformance
// suite's race catches.
func (w *s3Writer) CommitNew(ctx context.Context) error { return w.commit(ctx, true) }

// putOptions are the options of the request that makes the object visible.
func (w *s3Writer) putOptions(o minio.PutObjectOptions) minio.PutObjectOptions {
	o.ServerSideEncryption = w.s.sse
	if w.exclusive {
		o.SetMatchETagExcept("*")
	}
	return o
}

// lost tells what a conditional request's refusal means: nil where the
// object is this writer's own (an earlier attempt succeeded but its answer
// was lost), else ErrExists.
func (w *s3Writer) lost(ctx context.Context) error {
	var info minio.ObjectInfo
	err := w.s.retry(ctx, func(ctx context.Context) error {
		var err error
		info, err = w.s.core.StatObject(ctx, w.s.bucket, w.key, statOptions(w.s.sse))
		return err
	})
	if err == nil && info.UserMetadata[metaWriter] == w.token {
		return nil
	}
	return errdefs.ErrExists
}

func isPreconditionFailed(err error) bool {
	r := minio.ToErrorResponse(err)
	return r.Code == "PreconditionFailed" || r.StatusCode == http.StatusPreconditionFailed
}

func (w *s3Writer) commit(ctx context.Context, exclusive bool) (err error) {
	if w.finished {
		return fmt.Errorf("commit %s: %w", w.s.url(w.name), errFinished)
	}
	w.finished = true
	w.exclusive = exclusive
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
		_, err := w.s.core.CompleteMultipartUpload(ctx, w.s.bucket, w.key, w.uploadID, complete, w.putOptions(minio.PutObjectOptions{}))
		if w.exclusive && isPreconditionFailed(err) {
			return w.lost(ctx)
		}
		if err != nil && attempt > 1 && minio.ToErrorResponse(err).Code == "NoSuchUpload" {
			// An earlier attempt may have completed it and lost the answer;
			// the size check below decides.
			return nil
		}
		return err
	})
	if errors.Is(err, errdefs.ErrExists) {
		return err
	}
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
			w.putOptions(minio.PutObjectOptions{UserMetadata: map[string]string{hdrChecksumCRC32C: crc, metaWriter: w.token}, DisableContentSha256: true}))
		if w.exclusive && isPreconditionFailed(err) {
			return w.lost(ctx)
		}
		return err
	})
	if errors.Is(err, errdefs.ErrExists) {
		return err
	}
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
		info, err = w.s.core.StatObject(ctx, w.s.bucket, w.key, statOptions(w.s.sse))
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

// Abort implements store.ObjectWriter: it stops the part uploads and
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
