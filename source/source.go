package source

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
)

// Source serves the files of one checkpoint, whatever it is read from.
type Source interface {
	// Stat waits until the named file is known and complete, then returns
	// its entry; an error wrapping errdefs.ErrNotFound means the image lacks it.
	Stat(ctx context.Context, name string) (manifest.File, error)
	// Copy writes the whole file to w, every chunk checked before it is
	// written. It may be called more than once for a file.
	Copy(ctx context.Context, name string, w io.Writer) (int64, error)
	// Files waits until the whole checkpoint is known and lists it.
	Files(ctx context.Context) ([]manifest.File, error)
	// Close releases buffers and temporary files.
	Close() error
}

// Manifester is a Source that has its checkpoint's manifest before any
// file is read: an archive. Every decorator of a Source forwards it
// (ManifestOf of the source it wraps), so that the manifest is found
// however many decorators wrap the archive, where a type assertion to
// *ArchiveSource stops finding it behind one more. What a decorator
// changes of the files it serves (criusock's sparse pages) is not in the
// manifest: that records the checkpoint as stored.
type Manifester interface {
	// Manifest returns the manifest, or nil where there is none (a
	// decorator of a stream).
	Manifest() *manifest.Manifest
}

// ManifestOf returns src's manifest (Manifester): nil for a source that
// has none before it is read, such as a stream.
func ManifestOf(src Source) *manifest.Manifest {
	if m, ok := src.(Manifester); ok {
		return m.Manifest()
	}
	return nil
}

// FileCopier is a Source that writes a file into a regular file faster
// than Copy does (StreamSource.CopyToFile): f must hold no data yet.
type FileCopier interface {
	CopyToFile(ctx context.Context, name string, f *os.File) (int64, error)
}

// CopyToFile writes the named file of src into f, a regular file of no
// data: by src's CopyToFile where it is a FileCopier, else by Copy.
func CopyToFile(ctx context.Context, src Source, name string, f *os.File) (int64, error) {
	if fc, ok := src.(FileCopier); ok {
		return fc.CopyToFile(ctx, name, f)
	}
	return src.Copy(ctx, name, f)
}

// decodeChunk decodes payload into dst (len == raw length) and checks the
// raw checksum: the one place every restored byte is verified.
// A chunk stored raw (codec None) may be decoded in place: dst may be
// payload itself, which is then only read.
func decodeChunk(dst []byte, codecID uint8, checksum uint32, payload []byte) error {
	id := codec.ID(codecID)
	err := codec.DecodeChecked(id, dst, payload, checksum)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, errdefs.ErrCorrupt):
		return fmt.Errorf("decode %s chunk: %w", id, err)
	default: // an unknown codec id: in a stream, damage
		return fmt.Errorf("decode %s chunk: %v: %w", id, err, errdefs.ErrCorrupt)
	}
}

// openChunk is the reader stage before decoding: it authenticates and
// decrypts a sealed DATA payload in place and returns the encoded chunk and
// the raw bytes' CRC-32C. For a zero chunk the encoded chunk must be empty
// and the CRC that of zeros.
func openChunk(s *crypt.Session, payload []byte, ch crypt.Chunk) ([]byte, uint32, error) {
	enc, crc, err := s.OpenChunk(payload, ch)
	if err != nil {
		return nil, 0, fmt.Errorf("%s chunk of %d bytes: %w", codec.ID(ch.Codec), ch.RawLen, err)
	}
	return enc, crc, nil
}

// zeros is shared by every writer of zero chunks.
var zeros = make([]byte, 1<<20)

func writeZeros(w io.Writer, n int64) error {
	return zeroRuns(zeros, n, func(b []byte) error { _, err := w.Write(b); return err })
}

// zeroRuns hands n zero bytes to write in pieces of z, which is all zeros.
func zeroRuns(z []byte, n int64, write func([]byte) error) error {
	for n > 0 {
		k := min(n, int64(len(z)))
		if err := write(z[:k]); err != nil {
			return err
		}
		n -= k
	}
	return nil
}
