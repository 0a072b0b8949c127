package location

import (
	"context"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/streamer"
)

// StartCapture opens dest and starts the pipeline writing into it.
func StartCapture(ctx context.Context, dest Location, lc Config) (*streamer.Capture, *Output, error) {
	if lc.Options.LateData && dest.Kind != Stdio && dest.Kind != TCP && dest.Kind != StreamFile {
		return nil, nil, errdefs.Usagef("--pages-last: %s is no stream destination (stdout, a stream file, tcp://); an archive is read in any order", dest)
	}
	out, err := OpenOutput(ctx, dest, lc)
	if err != nil {
		return nil, nil, err
	}
	c, err := streamer.NewCapture(ctx, out, lc.Options)
	if err != nil {
		_ = out.Abort(ctx)
		return nil, nil, err
	}
	return c, out, nil
}

// AbortCapture ends a capture that must not commit.
func AbortCapture(ctx context.Context, c *streamer.Capture, cause error) {
	c.Abort(cause)
	_, _ = c.Close(ctx, manifest.Manifest{})
}
