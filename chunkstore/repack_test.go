package chunkstore

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store/mem"
)

// memPacks is a PackWriter into one pack held in memory.
type memPacks struct {
	id        PackID
	b         bytes.Buffer
	fail      error // every Write fails with it
	committed bool
	aborted   bool
}

func (w *memPacks) Write(_ context.Context, fh *manifest.FrameHeader, payload []byte) (PackID, int64, error) {
	if w.fail != nil {
		return PackID{}, 0, w.fail
	}
	pos := int64(w.b.Len())
	var h [manifest.FrameSize]byte
	fh.Marshal(h[:])
	w.b.Write(h[:])
	w.b.Write(payload)
	return w.id, pos, nil
}

func (w *memPacks) Commit(context.Context) ([]Pack, error) {
	w.committed = true
	return []Pack{{ID: w.id, Size: int64(w.b.Len())}}, nil
}

func (w *memPacks) Abort(context.Context) error { w.aborted = true; return nil }

// TestRepack: the marked frames of the packs repacked, and only those, go
// byte for byte into the new pack, where the table then finds them; a
// frame that is not the chunk marked, a pack gone or a writer that fails
// stops it, naming the pack, and the new packs are deleted.
func TestRepack(t *testing.T) {
	ctx := context.Background()
	a, b, kept := PackID{1}, PackID{2}, PackID{3}
	pa, ca := packBytes(a, 1, "alpha", "beta", "gamma")
	pb, cb := packBytes(b, 2, "delta", "epsilon")
	pk, ck := packBytes(kept, 3, "zeta")
	for _, tc := range []struct {
		name    string
		damage  func(pack []byte) // of pack a, before the repack
		gone    bool              // pack a is not there
		fail    error             // the writer's
		wantErr error
	}{
		{name: "copied"},
		{name: "damaged frame", damage: func(p []byte) { p[ca[1].Pos] ^= 0xff }, wantErr: errdefs.ErrCorrupt},
		{name: "pack gone", gone: true, wantErr: errdefs.ErrNotFound},
		{name: "writer fails", fail: errdefs.ErrNoRoom, wantErr: errdefs.ErrNoRoom},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := mem.New("loc")
			damaged := bytes.Clone(pa)
			if tc.damage != nil {
				tc.damage(damaged)
			}
			if !tc.gone {
				put(t, st, a.Name(), damaged)
			}
			put(t, st, b.Name(), pb)
			put(t, st, kept.Name(), pk)
			packs := []Pack{{ID: a, Size: int64(len(pa))}, {ID: b, Size: int64(len(pb))}, {ID: kept, Size: int64(len(pk))}}
			tbl := TableOf(packs, append(append(append([]Chunk{}, ca...), cb...), ck...))
			m := tbl.NewMarks()
			live := []Chunk{ca[1], cb[0], ck[0]} // beta and delta move, zeta stays
			for _, c := range live {
				m.Mark(c.ID, c.Pack, c.Pos, c.Stored)
			}
			w := &memPacks{id: PackID{9}, fail: tc.fail}
			n, err := m.Repack(ctx, st, []string{a.Name(), b.Name()}, w)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) || !strings.Contains(err.Error(), "repack mem://loc/") || !w.aborted || w.committed {
					t.Fatalf("repack: %d, %v (aborted %v, committed %v), want %v naming the pack, the new packs deleted", n, err, w.aborted, w.committed, tc.wantErr)
				}
				return
			}
			if err != nil || n != 1 || !w.committed || w.aborted {
				t.Fatalf("repack: %d, %v (committed %v, aborted %v)", n, err, w.committed, w.aborted)
			}
			frame := func(p []byte, c Chunk) []byte { return p[c.Pos : c.Pos+manifest.FrameSize+int64(c.Stored)] }
			if want := append(bytes.Clone(frame(pa, ca[1])), frame(pb, cb[0])...); !bytes.Equal(w.b.Bytes(), want) {
				t.Fatalf("new pack %q, want beta's and delta's frames as they were", w.b.Bytes())
			}
			for i, c := range live[:2] {
				want := c.Ref
				want.Pack, want.Pos = w.id, int64(i)*(manifest.FrameSize+int64(ca[1].Stored))
				if r, ok := tbl.Lookup(c.ID); !ok || r != want {
					t.Fatalf("chunk %s found at %+v, want %+v", c.ID, r, want)
				}
			}
			if r, _ := tbl.Lookup(ck[0].ID); r != ck[0].Ref {
				t.Fatalf("the chunk of the pack kept moved: %+v", r)
			}
		})
	}
}

// FuzzRepack: whatever a pack's bytes, repacking the frames the table
// places there copies each as a DATA frame of the length marked, or fails
// as corrupt data; it never panics.
func FuzzRepack(f *testing.F) {
	id := PackID{1}
	good, chunks := packBytes(id, 1, "alpha", "beta", "gamma")
	f.Add(good)
	f.Add(good[:len(good)/2])
	f.Fuzz(func(t *testing.T, b []byte) {
		st := mem.New("loc")
		put(t, st, id.Name(), b)
		tbl := TableOf([]Pack{{ID: id, Size: int64(len(good))}}, chunks)
		m := tbl.NewMarks()
		for _, c := range chunks {
			m.Mark(c.ID, c.Pack, c.Pos, c.Stored)
		}
		w := &memPacks{id: PackID{9}}
		_, err := m.Repack(context.Background(), st, []string{id.Name()}, w)
		if err != nil {
			return
		}
		var pos int64
		for _, c := range chunks {
			fh, err := manifest.UnmarshalFrameHeader(w.b.Bytes()[pos : pos+manifest.FrameSize])
			if err != nil || fh.Type != manifest.FrameData || fh.StoredLen != c.Stored {
				t.Fatalf("frame copied at %d: %+v, %v", pos, fh, err)
			}
			pos += manifest.FrameSize + int64(c.Stored)
		}
	})
}
