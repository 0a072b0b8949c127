package catalog

import (
	"context"
	"fmt"
	"path"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/store"
)

// ours says whether name, an object's name in a location or a directory's
// (a "/" at its end), is gpucr-stream's: a checkpoint's manifest or
// segment, a segments directory, or the chunk store and what it holds.
// gc removes nothing else.
func ours(name string) bool {
	if d, ok := strings.CutSuffix(name, "/"); ok {
		return path.Base(d) == segmentsDir("") || inChunkStore(name)
	}
	_, kind := checkpointPrefix(name)
	return kind != notOurs || inChunkStore(name)
}

// inChunkStore says name lies in a location's chunk store, this one's or
// one below.
func inChunkStore(name string) bool {
	return strings.HasPrefix(name, chunkstore.Dir) || strings.Contains(name, "/"+chunkstore.Dir)
}

// refuseForeign refuses a location that holds nothing gpucr-stream wrote
// (objs is its listing): gc there would at best do nothing, and a typo'd
// path must not be swept. Temporary files of dead writers count, for a
// store that has them: a first capture killed before it committed an
// object leaves only those.
func refuseForeign(ctx context.Context, st store.Store, objs []store.ObjectInfo, where string) error {
	for _, o := range objs {
		if ours(o.Name) {
			return nil
		}
	}
	if s, ok := st.(tempRemover); ok {
		names, err := s.RemoveTemp(ctx, time.Now(), true, ours)
		if err != nil || len(names) > 0 {
			return err
		}
	}
	return fmt.Errorf("%s: no checkpoint, segment or chunk store of gpucr-stream's there (nothing removed): %w",
		where, errdefs.ErrNotFound)
}
