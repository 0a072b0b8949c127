package source

import (
	"context"
	"fmt"
	"io"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
)

// earlyServe is the state of serving files as they arrive (ServeEarly),
// guarded by StreamSource.mu. A file is served once it is complete and
// checked; one whose FILE-END came ahead of its data (a capture's page
// images last, streamer/late.go) once its end is known and the chunks read
// ahead of it are in (arrivedLocked), copied as the rest arrives
// (copyArriving).
type earlyServe struct {
	log func(string) // takes a line for each file copied as it arrives
	// lateShards counts the shards that carried late data (Frame.Late):
	// once all have, every file of the stream has been announced, and a
	// name not among them never comes.
	lateShards int
}

// arrivedLocked says f's end is known and the chunks read ahead of it are
// in: a stream written with data after its FILE-END may then be served as
// it arrives.
func (f *streamFile) arrivedLocked() bool {
	return f.size >= 0 && f.aheadIn >= f.ahead
}

// noteEarly notes a DATA frame read from a shard, late saying whether an
// earlier one was late: it counts the shard among lateShards at its first
// late frame, and says whether the frame came ahead of its file's end
// (streamFile.ahead).
func (s *StreamSource) noteEarly(fr manifest.Frame, late *bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	f := s.pending[fr.FileID]
	ahead := f != nil && f.size < 0
	if ahead {
		f.ahead++
	}
	if fr.Late && !*late {
		*late = true
		s.early.lateShards++
		s.notifyLocked() // a name not announced yet never comes
	}
	return ahead
}

// pendingLocked says whether a file of that name is still arriving, and
// which of them, the latest opened, may be served as it arrives
// (arrivedLocked; nil: none).
func (s *StreamSource) pendingLocked(name string) (arrived *streamFile, pending bool) {
	for _, p := range s.pending {
		if p.name != name {
			continue
		}
		pending = true
		if p.arrivedLocked() && (arrived == nil || p.id > arrived.id) {
			arrived = p
		}
	}
	return arrived, pending
}

// logArriving says that f, still arriving, is copied as it arrives.
func (s *StreamSource) logArriving(f *streamFile) {
	if s.early == nil || s.early.log == nil {
		return
	}
	s.mu.Lock()
	var in int64
	for _, c := range f.chunks {
		in += c.n
	}
	size := f.size
	s.mu.Unlock()
	s.early.log(fmt.Sprintf("%s: copied as it arrives (%d of its %d bytes in)", manifest.PrintableName(f.name), in, size))
}

// copyArriving copies f, a file whose end is known but not all its chunks,
// in file order as they come, each once it is in and checked, and returns
// once f is complete, with how far it copied. Its last chunk waits for the
// whole file to check (maybeCompleteLocked): its reader never has all of a
// file that does not verify, and a stream that fails ends the copy short.
func (s *StreamSource) copyArriving(ctx context.Context, f *streamFile, cw chunkWriter, w io.Writer, buf *[]byte) (int64, error) {
	var next int64
	for {
		var c chunkRec
		found, done := false, false
		err := s.wait(ctx, func() bool {
			if done = s.doneIDs[f.id]; done {
				return true
			}
			for _, r := range f.chunks {
				if r.off == next && next+r.n < f.size {
					c, found = r, true
					return true
				}
			}
			return s.ended
		})
		switch {
		case err != nil:
			return next, err
		case done:
			s.mu.Lock()
			replaced := s.complete[f.name] != f
			s.mu.Unlock()
			if replaced {
				return next, fmt.Errorf("replaced by a later copy of it while it was copied: %w", errdefs.ErrCorrupt)
			}
			return next, nil
		case !found:
			return next, fmt.Errorf("stream ended with the file incomplete: %w", errdefs.ErrCorrupt)
		}
		if err := copyChunk(cw, w, c, buf); err != nil {
			return next, err
		}
		next += c.n
	}
}
