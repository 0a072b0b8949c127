package streamer

// The commit point: a checkpoint is its manifest, written last, only where
// none is (CommitNew). A commit that fails may still have landed (the
// store took the request and its answer was lost): the manifest is read
// back before the segments it may name are removed.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/store"
)

// commitManifest writes a checkpoint's manifest into st, its commit point.
func commitManifest(ctx context.Context, st store.Store, m *manifest.Manifest, format pipeline.Format) error {
	if err := m.Validate(); err != nil {
		return fmt.Errorf("refusing to commit: %w", err)
	}
	doc, err := pipeline.MarshalManifest(m, format.Seal)
	if err != nil {
		return err
	}
	w, err := st.Create(ctx, manifest.ManifestName)
	if err != nil {
		return fmt.Errorf("create manifest: %w", err)
	}
	if _, err := w.Write(doc); err != nil {
		_ = w.Abort(ctx)
		return fmt.Errorf("write manifest: %w", err)
	}
	// Only where no manifest is: the check in NewArchiveOutputAs was long
	// ago, and another capture to this location may have committed since.
	// The loser's segments (its own names) are removed by its Abort.
	if err := w.CommitNew(ctx); err != nil {
		_ = w.Abort(ctx)
		if errors.Is(err, errdefs.ErrExists) {
			return fmt.Errorf("a checkpoint was committed at %s by another capture meanwhile: %w", st, errdefs.ErrExists)
		}
		// The store may have taken the manifest and its answer been lost
		// (a server killed mid-request, the retries then refused): look
		// before the segments go, or a complete manifest is left over
		// removed segments.
		// Asked also when ctx has ended (an interrupt), within AbortTimeout.
		lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), AbortTimeout)
		defer cancel()
		landed, lerr := manifestLanded(lctx, st, doc)
		switch {
		case lerr != nil:
			return fmt.Errorf("commit manifest: %w; whether %s took it is unknown (%v), so the segments are left in place (`gpucr-stream check` of the location tells; `gpucr-stream gc` removes them if no manifest names them): %w", err, st, lerr, errCommitUnknown)
		case landed:
			return nil
		}
		return fmt.Errorf("commit manifest: %w", err)
	}
	return nil
}

// errCommitUnknown: a manifest's commit failed in a way the store may
// have acted on, and the store could not be asked: Abort leaves the
// segments, which the manifest may name.
var errCommitUnknown = errors.New("the checkpoint may be complete")

// manifestLanded says whether st holds doc as its manifest, byte for byte:
// a commit whose answer was lost.
func manifestLanded(ctx context.Context, st store.Store, doc []byte) (bool, error) {
	r, err := st.Open(ctx, manifest.ManifestName, 0, -1)
	if errors.Is(err, errdefs.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer r.Close()
	got, err := io.ReadAll(io.LimitReader(r, int64(len(doc))+1))
	if err != nil {
		return false, err
	}
	return bytes.Equal(got, doc), nil
}
