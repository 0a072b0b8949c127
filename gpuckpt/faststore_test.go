package gpuckpt

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/gpucr/gpucr-stream/vram"
	"github.com/gpucr/gpucr-stream/vram/vramtest"
)

// The store of the kept copy starts on each file as the copy out writes
// it whole, beside the rest of the copy out (suspend.go's table). The fake
// driver holds the copy of the mapping at the highest address (the last
// file's) until a put opens its gate (GPUCR_FAKE_DTOH_HOLD): a copy out
// that ends proves that a file went into the store before it did.

// gatedPut is put that opens gate when its first file begins, and
// records the order of the files begun.
type gatedPut struct {
	gate  string
	put   vram.PutFunc
	mu    sync.Mutex
	begun []string
}

func (g *gatedPut) Put(ctx context.Context, name string, r io.Reader) error {
	g.mu.Lock()
	if len(g.begun) == 0 {
		if err := os.WriteFile(g.gate, nil, 0o600); err != nil {
			g.mu.Unlock()
			return err
		}
	}
	g.begun = append(g.begun, name)
	g.mu.Unlock()
	return g.put(ctx, name, r)
}

func TestFastPathStoreBesideCopyOut(t *testing.T) {
	ctx := context.Background()
	gate := filepath.Join(t.TempDir(), "gate")
	tg := vramtest.Start(t, "GPUCR_FAKE_DTOH_HOLD="+gate)
	st := vramtest.NewStore()
	g := &gatedPut{gate: gate, put: st.Put}
	s, err := moveOut(ctx, []int{tg.PID}, g.Put, fastOpts(tg, t))
	if err != nil {
		t.Fatalf("the copy out waited for a store that never began: %v", err)
	}
	if _, err := os.Stat(gate + ".held"); err != nil {
		t.Fatalf("the last file's copy was never held (%v): the test proves nothing", err)
	}
	kept := map[string][]byte{}
	for i, k := range keptPaths(s, 0) {
		b, err := os.ReadFile(k)
		if err != nil {
			t.Fatal(err)
		}
		kept[s.fast.Procs()[0].Files[i]] = b
	}
	if err := s.fast.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	g.mu.Lock()
	begun := len(g.begun)
	g.mu.Unlock()
	if begun != 3 || len(st.Files) != 3 {
		t.Fatalf("%d files begun, %d stored, want 3", begun, len(st.Files))
	}
	for name, b := range kept {
		if !bytes.Equal(st.Files[name], b) {
			t.Fatalf("%s: stored %d bytes that are not the kept copy's %d", name, len(st.Files[name]), len(b))
		}
	}
	ps := s.FastStorePhases()
	if len(ps) != 2 || ps[0].Name != "vram store (beside the copy out and the dump)" || ps[0].Secs <= 0 || ps[1].Secs > ps[0].Secs {
		t.Fatalf("store phases: %+v", ps)
	}
	if err := undoAll(s); err != nil {
		t.Fatal(err)
	}
	tg.MustBeIntact(t)
}

// A copy out that fails once its other files went into the store: the
// store stops (its files still in flight are cancelled), the memory is
// still there, the program runs on, and nothing is left of the kept copy.
func TestFastPathCopyOutFailsWhileStoring(t *testing.T) {
	ctx := context.Background()
	gate := filepath.Join(t.TempDir(), "gate")
	tg := vramtest.Start(t, "GPUCR_FAKE_DTOH_HOLD="+gate, "GPUCR_FAKE_DTOH_HOLD_FAIL=1")
	used := tg.Report(t).DeviceUsed
	st := vramtest.NewStore()
	st.Block = make(chan struct{}) // never let go: the puts are in flight
	g := &gatedPut{gate: gate, put: st.Put}
	o := fastOpts(tg, t)
	s, err := moveOut(ctx, []int{tg.PID}, g.Put, o)
	if err == nil || !strings.Contains(err.Error(), "copy") {
		t.Fatalf("suspend: %v, want the copy out's failure", err)
	}
	g.mu.Lock()
	begun := len(g.begun)
	g.mu.Unlock()
	if begun == 0 {
		t.Fatal("no file went into the store before the copy out failed")
	}
	if err := s.fast.Wait(ctx); !errors.Is(err, vram.ErrUndone) {
		t.Fatalf("store after the failed copy out: %v, want %v", err, vram.ErrUndone)
	}
	if len(st.Files) != 0 {
		t.Fatalf("%d files stored", len(st.Files))
	}
	tg.MustBeIntact(t)
	if r := tg.Report(t); r.Parked || r.Released || r.DeviceUsed != used {
		t.Fatalf("after the undo: %+v, want running with %d bytes of device memory", r, used)
	}
	if ents, _ := os.ReadDir(o.KeepDir); len(ents) != 0 {
		t.Fatalf("kept copy left behind: %d files", len(ents))
	}
}
