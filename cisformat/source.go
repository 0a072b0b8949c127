package cisformat

// Design: rather than a second buffering, spilling and extracting engine, a
// criu-image-streamer stream is re-framed on the fly into a one-shard
// gpucr-stream stream (raw chunks, each with its CRC-32C, and a digest per
// file: format 3, without chunk hashes) and read by source.StreamSource
// through a pipe. Serving, the memory budget, spilling and extraction are
// then the ones gpucr-stream's own streams use. The legacy format has no
// checksums: those computed here only protect the bytes from here on.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
)

// chunkSize is the largest chunk re-framed; data of the current file is
// gathered up to it (the real tool's chunks are at most 256 KiB).
const chunkSize = 1 << 20

// Source serves the files of a criu-image-streamer stream. Its errors name
// the shard and offset of the damage.
type Source struct {
	*source.StreamSource
	rd   *Reader
	pr   *io.PipeReader
	done chan struct{}

	mu  sync.Mutex
	err error // why re-framing stopped, if it failed
}

// NewSource starts reading the shards (names label them in errors). Files
// named in external are marked as --ext-file-fds files.
func NewSource(ctx context.Context, shards []io.Reader, names []string, external []string, so source.StreamSourceOptions) *Source {
	pr, pw := io.Pipe()
	s := &Source{
		rd:   NewReader(ctx, shards, names),
		pr:   pr,
		done: make(chan struct{}),
	}
	ext := map[string]bool{}
	for _, n := range external {
		ext[n] = true
	}
	go func() {
		defer close(s.done)
		err := reframe(s.rd, pw, ext)
		if err != nil {
			s.mu.Lock()
			s.err = err
			s.mu.Unlock()
		}
		pw.CloseWithError(err)
	}()
	s.StreamSource = source.NewStreamSource(ctx, []io.Reader{pr}, []string{"criu-image-streamer stream"}, so)
	return s
}

// Explain prefers the error that stopped re-framing, which names the shard
// and offset in the original stream, over what the pipe made of it.
func (s *Source) Explain(err error) error {
	if err == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil && !errors.Is(s.err, io.ErrClosedPipe) {
		return s.err
	}
	return err
}

// Wait blocks until the whole stream has been read and checked.
func (s *Source) Wait(ctx context.Context) error {
	return s.Explain(s.StreamSource.Wait(ctx))
}

// Err returns the error that stopped the stream, if any.
func (s *Source) Err() error { return s.Explain(s.StreamSource.Err()) }

// Stat implements source.Source.
func (s *Source) Stat(ctx context.Context, name string) (manifest.File, error) {
	f, err := s.StreamSource.Stat(ctx, name)
	return f, s.Explain(err)
}

// Copy implements source.Source.
func (s *Source) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	n, err := s.StreamSource.Copy(ctx, name, w)
	return n, s.Explain(err)
}

// Files implements source.Source.
func (s *Source) Files(ctx context.Context) ([]manifest.File, error) {
	fs, err := s.StreamSource.Files(ctx)
	return fs, s.Explain(err)
}

// ShardStats returns the bytes read from each shard and how long each took,
// as the real tool's statistics line reports them. Call it after Wait
// returned nil.
func (s *Source) ShardStats() []ShardStat {
	<-s.done
	return s.rd.Stats()
}

// Close stops reading and releases buffers and temporary files.
func (s *Source) Close() error {
	err := s.StreamSource.Close()
	s.pr.Close()
	s.rd.Close()
	<-s.done
	return err
}

// reframe writes the image rd describes as a gpucr-stream stream.
func reframe(rd *Reader, w io.Writer, external map[string]bool) error {
	mw, err := manifest.NewWriter(w, manifest.Header{ShardCount: 1, StreamID: 1, NoChunkHashes: true})
	if err != nil {
		return err
	}
	r := &reframer{rd: rd, mw: mw, external: external, files: map[string]*reframed{}, buf: make([]byte, 0, chunkSize)}
	for {
		ev, err := rd.Next()
		if err == io.EOF {
			return mw.Finish(nil)
		}
		if err != nil {
			return err
		}
		switch ev.Kind {
		case Open:
			err = r.open(ev.Name)
		case Data:
			err = r.data(ev.Name, ev.Size)
		case Close:
			err = r.close(ev.Name)
		}
		if err != nil {
			return err
		}
	}
}

// reframer writes the real tool's events as our frames: a file's bytes
// are gathered into chunks of chunkSize (the tool's own pieces are
// whatever CRIU's pipe writes were).
type reframer struct {
	rd       *Reader
	mw       *manifest.Writer
	external map[string]bool
	files    map[string]*reframed
	nextID   uint32
	buf      []byte
	buffered *reframed // whose bytes buf holds
}

// reframed is a file being written: its id, bytes and chunks so far, and
// what its digest covers of them.
type reframed struct {
	id      uint32
	off     int64
	chunks  uint32
	covered []byte
}

func (r *reframer) open(name string) error {
	if r.files[name] != nil {
		return fmt.Errorf("file %s opened twice", name) // the Reader allows no such thing
	}
	r.files[name] = &reframed{id: r.nextID}
	fh := manifest.FrameHeader{Type: manifest.FrameFile, FileID: r.nextID}
	if r.external[name] {
		fh.Flags = manifest.FileFlagExternal
	}
	r.nextID++
	_, err := r.mw.WriteFrame(&fh, []byte(name))
	return err
}

func (r *reframer) data(name string, size int64) error {
	f := r.files[name]
	if r.buffered != f {
		if err := r.flush(); err != nil {
			return err
		}
		r.buffered = f
	}
	for left := size; left > 0; {
		n := min(left, int64(cap(r.buf)-len(r.buf)))
		k, err := io.ReadFull(r.rd, r.buf[len(r.buf):len(r.buf)+int(n)])
		r.buf = r.buf[:len(r.buf)+k]
		if err != nil {
			return r.rd.fail(err)
		}
		left -= n
		if len(r.buf) == cap(r.buf) {
			if err := r.flush(); err != nil {
				return err
			}
		}
	}
	return nil
}

func (r *reframer) close(name string) error {
	f := r.files[name]
	if r.buffered == f {
		if err := r.flush(); err != nil {
			return err
		}
		r.buffered = nil
	}
	delete(r.files, name)
	fh := manifest.FrameHeader{Type: manifest.FrameFileEnd, FileID: f.id, Offset: uint64(f.off),
		RawLen: f.chunks, Hash: pipeline.FileDigest(f.covered, f.off)}
	_, err := r.mw.WriteFrame(&fh, nil)
	return err
}

// flush writes the gathered bytes as one DATA frame of the buffered file.
func (r *reframer) flush() error {
	if len(r.buf) == 0 {
		return nil
	}
	f := r.buffered
	fh := manifest.FrameHeader{Type: manifest.FrameData, Codec: uint8(codec.None), FileID: f.id, Offset: uint64(f.off),
		RawLen: uint32(len(r.buf)), Checksum: codec.Checksum(r.buf)}
	if _, err := r.mw.WriteFrame(&fh, r.buf); err != nil {
		return err
	}
	f.off += int64(len(r.buf))
	f.covered = pipeline.AppendDigestCRC(f.covered, fh.Checksum, fh.RawLen)
	f.chunks++
	r.buf = r.buf[:0]
	return nil
}
