// Package errdefs holds the kinds of failure that every package of
// gpucr-stream wraps, so that callers, and the command's exit codes, tell
// them apart with errors.Is whatever room the error came from.
package errdefs

import (
	"errors"
	"fmt"
)

var (
	// ErrCorrupt: data failed a checksum or a structural check. Messages
	// that wrap it name the file (or object) and the offset.
	ErrCorrupt = errors.New("corrupt data")
	// ErrNotFound: a checkpoint, archive, segment, object, file or process
	// that is not there.
	ErrNotFound = errors.New("not found")
	// ErrExists: an object (a checkpoint's manifest) that must be new was
	// committed by another writer first; the losing writer's object is
	// discarded.
	ErrExists = errors.New("already exists")
	// ErrUsage: a bad argument, found by a library below the command line
	// (a --gpu-map that does not fit the checkpoint's GPUs, a destination
	// that cannot be written); the command exits 2 for it.
	ErrUsage = errors.New("bad usage")
	// ErrInterrupted: the user stopped the command (SIGINT, SIGTERM); the
	// command exits 130 for it. Messages that wrap it say what became of
	// the work, and of the process where one was being checkpointed.
	ErrInterrupted = errors.New("interrupted")
	// ErrNoRoom: the host has not the memory or disk space a step needs
	// (the fast path's kept copy); the step was refused before it began.
	ErrNoRoom = errors.New("not enough room on this host")
)

// Usagef is an error wrapping ErrUsage whose message is the formatted text
// alone.
func Usagef(format string, args ...any) error {
	return usageError(fmt.Sprintf(format, args...))
}

type usageError string

func (e usageError) Error() string        { return string(e) }
func (e usageError) Is(target error) bool { return target == ErrUsage }
