// Package streamer is the staged pipeline engine: it cuts image files into
// chunks, encodes them on a pool of workers within a memory budget, writes
// frames in order to an output, and runs the same stages backwards to serve
// files from a stream or an indexed archive. It knows nothing of CRIU or of
// particular storage systems; those plug in through Output, Store and the
// io interfaces.
package streamer

import (
	"context"
	"io"
	"time"
)

// Store is object storage for archives: a local directory, an S3 prefix.
// Objects become visible only when their writer commits, which is what makes
// the manifest-last rule work.
type Store interface {
	// Create starts a new object; nothing is visible under name until Commit.
	Create(ctx context.Context, name string) (ObjectWriter, error)
	// Open reads length bytes from off (length < 0: to the end).
	Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error)
	// Stat returns an object's size, or an error wrapping errdefs.ErrNotFound.
	Stat(ctx context.Context, name string) (ObjectInfo, error)
	// List returns the objects whose names start with prefix, sorted by name.
	List(ctx context.Context, prefix string) ([]ObjectInfo, error)
	// Delete removes an object; deleting a missing object is not an error.
	Delete(ctx context.Context, name string) error
	// String names the store for messages, without secrets.
	String() string
}

// ObjectWriter receives one object's bytes.
type ObjectWriter interface {
	io.Writer
	// Commit makes the object durable and visible, after checking that every
	// written byte arrived.
	Commit(ctx context.Context) error
	// Abort discards the object; it is safe after a failed Commit.
	Abort(ctx context.Context) error
}

// ObjectInfo describes a stored object.
type ObjectInfo struct {
	Name     string
	Size     int64
	Modified time.Time
}
