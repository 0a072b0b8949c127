// Package store is object storage for archives: the Store interface that
// local directories (store/dir), S3 (store/s3) and memory (store/mem)
// implement, and the conformance suite (store/storetest) each passes. A
// missing object is an error wrapping errdefs.ErrNotFound. Over any
// store: locks that tell gc a writer lives (lock.go), and the check a
// commit makes that what it names is there (Missing).
package store

import (
	"context"
	"fmt"
	"io"
	"strings"
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
	// CommitNew is Commit that succeeds only where no object of this name
	// exists, decided atomically by the store: of writers racing to commit
	// one name, exactly one wins, and each other one gets an error
	// wrapping errdefs.ErrExists, its object discarded as by Abort. A
	// checkpoint's manifest, its commit point, is committed this way, so
	// that two captures to one destination never both succeed.
	CommitNew(ctx context.Context) error
	// Abort discards the object; it is safe after a failed Commit.
	Abort(ctx context.Context) error
}

// ObjectInfo describes a stored object.
type ObjectInfo struct {
	Name     string
	Size     int64
	Modified time.Time
}

// CheckName refuses object names that could leave a store's root: empty,
// absolute, with "..", or with NUL. Every backend calls it first.
func CheckName(name string) error {
	if name == "" || strings.Contains(name, "..") || strings.HasPrefix(name, "/") || strings.ContainsRune(name, 0) {
		return fmt.Errorf("invalid object name %q", name)
	}
	return nil
}
