package streamer

import (
	"context"
	"errors"

	"github.com/gpucr/gpucr-stream/manifest"
)

// TeeOutput writes every frame to two outputs, e.g. a peer and a local
// copy kept until the peer confirms. The locations it returns (and so the
// manifest's index) are Copy's; Copy commits first, Primary second.
type TeeOutput struct {
	Primary, Copy Output
}

// WriteFrame implements Output.
func (t TeeOutput) WriteFrame(ctx context.Context, fh *manifest.FrameHeader, payload []byte) (Location, error) {
	h := *fh
	if _, err := t.Primary.WriteFrame(ctx, &h, payload); err != nil {
		return Location{}, err
	}
	h = *fh
	return t.Copy.WriteFrame(ctx, &h, payload)
}

// Commit implements Output.
func (t TeeOutput) Commit(ctx context.Context, m *manifest.Manifest) error {
	if err := t.Copy.Commit(ctx, m); err != nil {
		return err
	}
	return t.Primary.Commit(ctx, m)
}

// Abort implements Output.
func (t TeeOutput) Abort(ctx context.Context) error {
	return errors.Join(t.Primary.Abort(ctx), t.Copy.Abort(ctx))
}
