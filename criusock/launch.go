package criusock

// CRIU run by someone else for a dump or restore this process streams: a
// container runtime whose CRIU is gpucr-stream's swrk (packages swrk and
// container). The capture or serve listens in the images dir as for CRIU
// run here, and swrk asks the same committer at CRIU's post-dump
// (AskCommit) that the action script asks otherwise.

import (
	"context"
	"time"

	"github.com/gpucr/gpucr-stream/source"
)

// Launcher runs a dump or restore by way of a container runtime.
type Launcher interface {
	// Dump checkpoints through the runtime into l.ImagesDir.
	Dump(ctx context.Context, l Launch) (Launched, error)
	// Restore restores through the runtime from l.ImagesDir and names
	// the restored root.
	Restore(ctx context.Context, l Launch) (Launched, error)
	// Carried are the files the runtime keeps beside CRIU's images:
	// carried from these paths on dump (relative: in the images dir),
	// written back into the images dir under their names before a
	// restore runs.
	Carried() []string
	// PostDump runs at CRIU's post-dump, the tree frozen, before the
	// commit: files it writes into imagesDir that Carried names ride in
	// the checkpoint.
	PostDump(ctx context.Context, imagesDir string) error
}

// Launch is one dump or restore for a Launcher.
type Launch struct {
	// CRIU is the real criu binary swrk is to run.
	CRIU string
	// ImagesDir holds the streamer socket; WorkDir is where CRIU's logs go.
	ImagesDir, WorkDir string
	// Args are CRIU options to add to the runtime's (--criu-opts, a
	// network lock method).
	Args []string
	// Commit is the committer's directory (dump): at CRIU's post-dump the
	// runtime's CRIU asks it to commit (AskCommit) before the runtime
	// hears of post-dump, and fails the step if it refuses.
	Commit       string
	LeaveRunning bool
	// Src is the checkpoint being restored: files the runtime needs
	// besides CRIU's images come from it.
	Src source.Source
	// Version is CRIU's version, being asked (nil: not asked), for the
	// runtime's swrk to answer the runtime's VERSION request with (a
	// dump asks it anyway, for its manifest, while it gets ready; a
	// restore, which has nothing to do meanwhile, leaves the request to
	// criu).
	Version *VersionQuery
}

// Launched is what a Launcher did.
type Launched struct {
	PID int // restore: the restored root
	// Log is CRIU's log, Output the runtime's, for error messages.
	Log, Output string
	Took        time.Duration
}
