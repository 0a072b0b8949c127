package imagestreamer

// Design: rather than a second buffering, spilling and extracting engine, a
// criu-image-streamer stream is re-framed on the fly into a one-shard
// gpucr-stream stream (raw chunks, each with its CRC-32C and BLAKE3 hash,
// and a digest per file) and read by streamer.StreamSource through a pipe.
// Serving, the memory budget, spilling and extraction are then the ones
// gpucr-stream's own streams use. The legacy format has no checksums: the
// hashes computed here only protect the bytes from here on.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/streamer"
)

// chunkSize is the largest chunk re-framed; data of the current file is
// gathered up to it (the real tool's chunks are at most 256 KiB).
const chunkSize = 1 << 20

// Source serves the files of a criu-image-streamer stream. Its errors name
// the shard and offset of the damage.
type Source struct {
	*streamer.StreamSource
	rd   *Reader
	pr   *io.PipeReader
	done chan struct{}

	mu  sync.Mutex
	err error // why re-framing stopped, if it failed
}

// NewSource starts reading the shards (names label them in errors). Files
// named in external are marked as --ext-file-fds files.
func NewSource(ctx context.Context, shards []io.Reader, names []string, external []string, so streamer.StreamOptions) *Source {
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
	s.StreamSource = streamer.NewStreamSource(ctx, []io.Reader{pr}, []string{"criu-image-streamer stream"}, so)
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

// Stat implements streamer.Source.
func (s *Source) Stat(ctx context.Context, name string) (manifest.File, error) {
	f, err := s.StreamSource.Stat(ctx, name)
	return f, s.Explain(err)
}

// Copy implements streamer.Source.
func (s *Source) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	n, err := s.StreamSource.Copy(ctx, name, w)
	return n, s.Explain(err)
}

// Files implements streamer.Source.
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
	mw, err := manifest.NewWriter(w, manifest.Header{ShardCount: 1, StreamID: 1})
	if err != nil {
		return err
	}
	type file struct {
		id     uint32
		off    int64
		hashes []byte
	}
	files := map[string]*file{}
	nextID := uint32(0)
	buf := make([]byte, 0, chunkSize)
	var buffered *file // whose bytes buf holds
	flush := func() error {
		if len(buf) == 0 {
			return nil
		}
		f := buffered
		h := codec.ContentHash(buf)
		fh := manifest.FrameHeader{Type: manifest.FrameData, Codec: uint8(codec.None), FileID: f.id, Offset: uint64(f.off),
			RawLen: uint32(len(buf)), Checksum: codec.Checksum(buf), Hash: h}
		if _, err := mw.WriteFrame(&fh, buf); err != nil {
			return err
		}
		f.off += int64(len(buf))
		f.hashes = append(f.hashes, h[:]...)
		buf = buf[:0]
		return nil
	}
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
			if f := files[ev.Name]; f != nil {
				return fmt.Errorf("file %s opened twice", ev.Name) // the Reader allows no such thing
			}
			files[ev.Name] = &file{id: nextID}
			fh := manifest.FrameHeader{Type: manifest.FrameFile, FileID: nextID}
			if external[ev.Name] {
				fh.Flags = manifest.FileFlagExternal
			}
			nextID++
			if _, err := mw.WriteFrame(&fh, []byte(ev.Name)); err != nil {
				return err
			}
		case Data:
			f := files[ev.Name]
			if buffered != f {
				if err := flush(); err != nil {
					return err
				}
				buffered = f
			}
			for left := ev.Size; left > 0; {
				n := min(left, int64(cap(buf)-len(buf)))
				k, err := io.ReadFull(rd, buf[len(buf):len(buf)+int(n)])
				buf = buf[:len(buf)+k]
				if err != nil {
					return rd.fail(err)
				}
				left -= n
				if len(buf) == cap(buf) {
					if err := flush(); err != nil {
						return err
					}
				}
			}
		case Close:
			f := files[ev.Name]
			if buffered == f {
				if err := flush(); err != nil {
					return err
				}
				buffered = nil
			}
			delete(files, ev.Name)
			fh := manifest.FrameHeader{Type: manifest.FrameFileEnd, FileID: f.id, Offset: uint64(f.off),
				RawLen: uint32(len(f.hashes) / 32), Hash: streamer.FileDigest(f.hashes, f.off)}
			if _, err := mw.WriteFrame(&fh, nil); err != nil {
				return err
			}
		}
	}
}
