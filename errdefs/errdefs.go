// Package errdefs holds the kinds of failure that every package of
// gpucr-stream wraps, so that callers, and the command's exit codes, tell
// them apart with errors.Is whatever room the error came from.
package errdefs

import "errors"

var (
	// ErrCorrupt: data failed a checksum or a structural check. Messages
	// that wrap it name the file (or object) and the offset.
	ErrCorrupt = errors.New("corrupt data")
	// ErrNotFound: a checkpoint, archive, segment, object, file or process
	// that is not there.
	ErrNotFound = errors.New("not found")
)
