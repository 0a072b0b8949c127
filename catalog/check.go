package catalog

// Check of a location (restic's check and repair index are the model,
// docs/FORMAT.md section 17.8): read every pack's frame headers
// (chunkstore.ScanPacks), compare the index with what the packs hold
// (Scan.Stale), and find, for every complete checkpoint, each chunk where
// a reader will look for it (a deduplicated one: chunkstore.CheckChunks)
// or each segment its manifest names (a plain one). Nothing is written or
// deleted unless asked: RepairIndex replaces the index objects by one
// rebuilt from the packs.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/gpucr/gpucr-stream/chunkstore"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
)

// CheckOptions say what Check does besides reading.
type CheckOptions struct {
	// Where names the location in the report (default: the store's name).
	Where string
	// RepairIndex: where the index is not what the packs hold (objects
	// that cannot be read, chunks it places where no such frame is,
	// chunks of packs it does not list), write one index object listing
	// every chunk the packs hold, then delete the index objects there
	// were. Only while no capture or gc holds the location.
	RepairIndex bool
	// ReadData: decode every checkpoint whole and check every checksum
	// and hash (verify), with Read's key, workers and memory limit. An
	// encrypted checkpoint of another key, or without Read.Key, is not
	// read (NotRead).
	ReadData bool
	Read     pipeline.Options
}

// CheckReport is what Check found. OK is false when anything is damaged:
// Err then says what, wrapping errdefs.ErrCorrupt.
type CheckReport struct {
	Location    string `json:"location"`
	OK          bool   `json:"ok"`
	Checkpoints int    `json:"checkpoints"`
	Dedup       int    `json:"dedup_checkpoints"`
	// Packs are the chunk store's packs, their bytes, and the chunks
	// their frames hold (a chunk stored twice counts twice).
	Packs        int   `json:"packs"`
	PackBytes    int64 `json:"pack_bytes"`
	Chunks       int   `json:"chunks"`
	IndexObjects int   `json:"index_objects"`
	// BadIndex are index objects that cannot be read; BadPacks, packs
	// damaged from some offset on (their chunks before it count).
	BadIndex []Problem `json:"bad_index,omitempty"`
	BadPacks []Problem `json:"bad_packs,omitempty"`
	// StaleIndex counts the chunks the index places where no such frame
	// is (a capture would reference them), StaleExample names one.
	StaleIndex   int    `json:"stale_index_chunks,omitempty"`
	StaleExample string `json:"stale_index_example,omitempty"`
	// Unindexed counts the chunks the packs hold that no index object
	// lists: captures store them again, and a checkpoint gc repacked
	// cannot find them. Harmless unless such a checkpoint needs them
	// (it is then in Damaged); packs of captures in flight, or of failed
	// ones that gc has not removed yet, hold such chunks.
	Unindexed int `json:"unindexed_chunks,omitempty"`
	// Repaired says what RepairIndex did.
	Repaired *IndexRepair `json:"repaired,omitempty"`
	// Damaged are checkpoints that cannot be restored whole, and why.
	Damaged []Problem `json:"damaged,omitempty"`
	// ReadData: the checkpoints decoded whole, their raw bytes, and those
	// not read, and why.
	ReadData bool      `json:"read_data,omitempty"`
	Verified int       `json:"verified,omitempty"`
	Bytes    int64     `json:"verified_bytes,omitempty"`
	NotRead  []Problem `json:"not_read,omitempty"`
}

// IndexRepair is what RepairIndex did: the index object it wrote, with how
// many chunks, and how many it replaced.
type IndexRepair struct {
	Written string `json:"written"`
	Chunks  int    `json:"chunks"`
	Removed int    `json:"removed"`
}

// Err is nil for a clean location, else an error wrapping
// errdefs.ErrCorrupt that counts what is wrong.
func (r *CheckReport) Err() error {
	if r.OK {
		return nil
	}
	var what []string
	add := func(n int, s string) {
		if n > 0 {
			what = append(what, fmt.Sprintf("%d %s", n, s))
		}
	}
	add(len(r.Damaged), "damaged checkpoint(s)")
	add(len(r.BadPacks), "damaged pack(s)")
	if r.indexDamaged() {
		add(len(r.BadIndex), "unreadable index object(s)")
		add(r.StaleIndex, "index entries of chunks that are not there")
	}
	return fmt.Errorf("check %s: %s: %w", r.Location, strings.Join(what, ", "), errdefs.ErrCorrupt)
}

// indexDamaged says the index is damaged and was not repaired.
func (r *CheckReport) indexDamaged() bool {
	return r.Repaired == nil && (len(r.BadIndex) > 0 || r.StaleIndex > 0)
}

// damage says err is something wrong with what the store holds (corrupt,
// gone, or of a newer version), not a failure to read it.
func damage(err error) bool {
	return errors.Is(err, errdefs.ErrCorrupt) || errors.Is(err, errdefs.ErrNotFound) || errors.Is(err, manifest.ErrNewerVersion)
}

// Check checks the location st (see the top of this file). Its error is
// for a check that could not be made (a store that fails, a gc that holds
// the location); what it finds damaged is in the report (OK, Err).
func Check(ctx context.Context, st store.Store, opts CheckOptions) (*CheckReport, error) {
	rep := &CheckReport{Location: opts.Where, ReadData: opts.ReadData}
	if rep.Location == "" {
		rep.Location = st.String()
	}
	chunkObjs, err := st.List(ctx, chunkstore.Dir)
	if err != nil {
		return nil, err
	}
	if len(chunkObjs) > 0 {
		lock, err := checkLock(ctx, st, opts.RepairIndex)
		if err != nil {
			return nil, err
		}
		defer lock.Release(ctx)
	}
	// The listing once the lock is held: every pack a committed manifest
	// names is in it, and no gc removes one while the check runs.
	objs, err := st.List(ctx, "")
	if err != nil {
		return nil, err
	}
	var sc *chunkstore.Scan
	var idx *chunkstore.Table
	if len(chunkObjs) > 0 {
		if sc, idx, err = checkChunkStore(ctx, st, objs, opts.RepairIndex, rep); err != nil {
			return nil, err
		}
	}
	sizes := make(map[string]int64, len(objs))
	for _, o := range objs {
		sizes[o.Name] = o.Size
	}
	var mu sync.Mutex
	var whole []string // checkpoints to read: found whole, or past damage check could not see
	err = eachManifest(ctx, st, objs, func(p string, m *manifest.Manifest, err error) error {
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil // removed since the listing
		}
		if err == nil {
			if m.SharedChunks {
				err = chunkstore.CheckChunks(m, idx, sc)
			} else {
				err = checkSegments(p, m, sizes)
			}
		} else if !damage(err) {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		rep.Checkpoints++
		if m != nil && m.SharedChunks {
			rep.Dedup++
		}
		switch {
		case err == nil || (opts.ReadData && errors.Is(err, chunkstore.ErrPastDamage)):
			whole = append(whole, p)
		default:
			rep.Damaged = append(rep.Damaged, Problem{Name: Join(rep.Location, strings.TrimSuffix(p, "/")), Error: err.Error()})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if opts.ReadData {
		slices.Sort(whole)
		if err := readData(ctx, st, whole, opts.Read, rep); err != nil {
			return nil, err
		}
	}
	for _, ps := range []*[]Problem{&rep.Damaged, &rep.BadPacks, &rep.BadIndex, &rep.NotRead} {
		slices.SortFunc(*ps, func(a, b Problem) int { return strings.Compare(a.Name, b.Name) })
	}
	rep.OK = len(rep.Damaged) == 0 && len(rep.BadPacks) == 0 && !rep.indexDamaged()
	return rep, nil
}

// checkLock keeps gc away while check reads (a check lock, shared with
// captures), or, to repair, everyone (a gc lock, exclusive): captures that
// start meanwhile see it and share nothing, so no capture loads the index
// objects the repair replaces.
func checkLock(ctx context.Context, st store.Store, repair bool) (*chunkstore.Lock, error) {
	kind := chunkstore.LockCheck
	if repair {
		kind = chunkstore.LockGC
	}
	lock, err := chunkstore.TakeLock(ctx, st, kind)
	if err != nil {
		return nil, err
	}
	held := lock.Others[chunkstore.LockGC]
	if repair {
		held = lock.Held()
	}
	if len(held) > 0 {
		lock.Release(ctx)
		what := "a gc holds the location"
		if repair {
			what = "captures, checks or a gc hold the location; the index is repaired only while none runs"
		}
		return nil, fmt.Errorf("%s: %s (%v): run check again once they end", st, what, held)
	}
	return lock, nil
}

// checkChunkStore reads the index and every pack of the location st
// (listed in objs) into rep, repairs the index if asked and needed, and
// returns the scan and the index a reader would use.
func checkChunkStore(ctx context.Context, st store.Store, objs []store.ObjectInfo, repair bool, rep *CheckReport) (*chunkstore.Scan, *chunkstore.Table, error) {
	present := map[chunkstore.PackID]int64{}
	var indexes []string
	for _, o := range objs {
		if id, ok := chunkstore.ParsePackName(o.Name); ok {
			present[id] = o.Size
			rep.PackBytes += o.Size
		} else if chunkstore.IsIndexName(o.Name) {
			indexes = append(indexes, o.Name)
		}
	}
	rep.Packs, rep.IndexObjects = len(present), len(indexes)
	idx, err := chunkstore.Load(ctx, st)
	if err != nil {
		return nil, nil, err
	}
	sc, err := chunkstore.ScanPacks(ctx, st, present)
	if err != nil {
		return nil, nil, err
	}
	rep.Chunks = sc.Table.Len()
	for id, p := range sc.Packs {
		if p.Err != nil {
			rep.BadPacks = append(rep.BadPacks, Problem{Name: id.Name(), Error: p.Err.Error()})
		}
	}
	for _, b := range idx.Skipped() {
		rep.BadIndex = append(rep.BadIndex, Problem{Name: b.Name, Error: b.Err.Error()})
	}
	rep.StaleIndex, rep.StaleExample, rep.Unindexed = sc.Stale(idx)
	if !repair || (len(rep.BadIndex) == 0 && rep.StaleIndex == 0 && rep.Unindexed == 0) {
		return sc, idx, nil
	}
	// The new object first: until the old ones go, both are read.
	name, err := sc.WriteIndex(ctx, st, idx)
	if err != nil {
		return nil, nil, err
	}
	n, err := removeObjects(ctx, st, indexes)
	if err != nil {
		return nil, nil, fmt.Errorf("repair the index: %s written, but %d of the %d index objects it replaces remain: %w", name, len(indexes)-n, len(indexes), err)
	}
	rep.Repaired = &IndexRepair{Written: name, Chunks: sc.Table.Len(), Removed: n}
	return sc, sc.Table, nil
}

// checkSegments checks that every segment the manifest m of the plain
// checkpoint at prefix names is in sizes (the location's objects), with
// the size m gives.
func checkSegments(prefix string, m *manifest.Manifest, sizes map[string]int64) error {
	var missing, wrong []string
	for _, s := range m.Segments {
		switch size, ok := sizes[prefix+s.Name]; {
		case !ok:
			missing = append(missing, s.Name)
		case size != s.Size:
			wrong = append(wrong, fmt.Sprintf("%s (%d bytes, the manifest says %d)", s.Name, size, s.Size))
		}
	}
	switch {
	case len(missing) > 0:
		return fmt.Errorf("%d of its %d segments are gone: %s", len(missing), len(m.Segments), strings.Join(missing, ", "))
	case len(wrong) > 0:
		return fmt.Errorf("%d of its %d segments have another size: %s", len(wrong), len(m.Segments), strings.Join(wrong, ", "))
	}
	return nil
}

// readData decodes the checkpoints at prefixes whole (VerifyArchive), one
// after another, into rep.
func readData(ctx context.Context, st store.Store, prefixes []string, opts pipeline.Options, rep *CheckReport) error {
	for _, p := range prefixes {
		sub := store.Sub(st, p)
		name := Join(rep.Location, strings.TrimSuffix(p, "/"))
		m, err := source.ReadManifest(ctx, sub)
		if err != nil {
			if !damage(err) {
				return err
			}
			rep.Damaged = append(rep.Damaged, Problem{Name: name, Error: err.Error()})
			continue
		}
		o := opts
		o.VerifyHashes, o.Key = true, nil
		if e := m.Encryption; e != nil {
			if opts.Key == nil || opts.Key.ID() != crypt.KeyID(e.KeyID) {
				rep.NotRead = append(rep.NotRead, Problem{Name: name, Error: fmt.Sprintf("encrypted under key %s: give it (--key-file) to read it", crypt.KeyID(e.KeyID))})
				continue
			}
			o.Key = opts.Key
		}
		a, err := source.OpenArchive(ctx, sub, o)
		var vr source.VerifyReport
		if err == nil {
			vr, err = source.VerifyArchive(ctx, a)
			a.Close()
		}
		if err != nil {
			if !damage(err) { // a failed authentication is corrupt too
				return err
			}
			rep.Damaged = append(rep.Damaged, Problem{Name: name, Error: err.Error()})
			continue
		}
		rep.Verified++
		rep.Bytes += vr.Bytes
	}
	return nil
}
