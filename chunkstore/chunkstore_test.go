package chunkstore

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/mem"
)

func randomChunks(n int, packs []Pack, seed uint64) []Chunk {
	r := rand.New(rand.NewPCG(seed, 1))
	out := make([]Chunk, n)
	for i := range out {
		c := &out[i]
		for k := 0; k < 32; k += 8 {
			v := r.Uint64()
			for j := range 8 {
				c.ID[k+j] = byte(v >> (8 * j))
			}
		}
		c.Pack = packs[r.IntN(len(packs))].ID
		c.Pos = int64(r.IntN(1 << 20))
		c.RawLen, c.Stored, c.Codec, c.Checksum = uint32(1+r.IntN(4<<20)), uint32(r.IntN(1<<20)), uint8(r.IntN(6)), r.Uint32()
	}
	return out
}

func testPacks(n int) []Pack {
	packs := make([]Pack, n)
	for i := range packs {
		packs[i] = Pack{ID: NewPackID(), Size: 4 << 20}
	}
	return packs
}

func TestIndexRoundTrip(t *testing.T) {
	ctx := context.Background()
	st := mem.New("loc")
	packs := testPacks(3)
	first := randomChunks(1000, packs[:2], 1)
	second := randomChunks(500, packs[2:], 2)
	dup := first[7] // an id written twice, in two packs
	dup.Pack = packs[2].ID
	second = append(second, dup)
	for _, part := range []struct {
		packs  []Pack
		chunks []Chunk
	}{{packs[:2], first}, {packs[2:], second}} {
		if _, err := WriteIndex(ctx, st, part.packs, part.chunks); err != nil {
			t.Fatal(err)
		}
	}
	tbl, err := Load(ctx, st)
	if err != nil {
		t.Fatal(err)
	}
	if tbl.Len() != 1500 {
		t.Fatalf("%d chunks, want 1500", tbl.Len())
	}
	for _, c := range append(first, second...) {
		r, ok := tbl.Lookup(c.ID)
		if c.ID == dup.ID && (r == first[7].Ref || r == dup.Ref) {
			continue // either copy serves
		}
		if !ok || r != c.Ref {
			t.Fatalf("lookup %s: %+v %v, want %+v", c.ID, r, ok, c.Ref)
		}
	}
	if _, ok := tbl.Lookup(manifest.Hash{1}); ok {
		t.Fatal("found an id never written")
	}
	tbl.Add(manifest.Hash{1}, Ref{Pack: packs[0].ID, RawLen: 1})
	if !tbl.Has(manifest.Hash{1}) || tbl.Len() != 1501 {
		t.Fatal("an added chunk is not found")
	}
	if size, ok := tbl.PackSize(packs[2].ID); !ok || size != 4<<20 {
		t.Fatalf("pack size %d %v", size, ok)
	}
}

func TestDecodeIndexRejects(t *testing.T) {
	packs := testPacks(1)
	good, err := MarshalIndex(packs, randomChunks(3, packs, 3))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		mod  func([]byte) []byte
	}{
		{"truncated", func(b []byte) []byte { return b[:len(b)-1] }},
		{"bad magic", func(b []byte) []byte { b[0] = 'X'; return b }},
		{"flipped entry byte", func(b []byte) []byte { b[len(b)-10] ^= 1; return b }},
		{"more chunks than bytes", func(b []byte) []byte { b[16] = 200; return b }},
		{"empty", func(b []byte) []byte { return nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.mod(bytes.Clone(good))
			if _, _, err := DecodeIndex(bytes.NewReader(b), int64(len(b))); !errors.Is(err, errdefs.ErrCorrupt) {
				t.Fatalf("got %v, want corrupt", err)
			}
		})
	}
}

func FuzzDecodeIndex(f *testing.F) {
	packs := testPacks(2)
	good, _ := MarshalIndex(packs, randomChunks(4, packs, 4))
	f.Add(good)
	f.Fuzz(func(t *testing.T, b []byte) {
		packs, chunks, err := DecodeIndex(bytes.NewReader(b), int64(len(b)))
		if err != nil {
			return
		}
		again, err := MarshalIndex(packs, chunks)
		if err != nil || !bytes.Equal(again, b) {
			t.Fatalf("a decoded index does not encode to the same bytes: %v", err)
		}
	})
}

// TestTableMemory measures what the table holds per chunk: a million must
// fit well under 128 MiB (issue 22).
func TestTableMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates a million entries")
	}
	const n = 1 << 20
	packs := testPacks(256)
	chunks := randomChunks(n, packs, 5)
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	tbl := NewTable()
	tbl.insert(packs, chunks)
	tbl.finish()
	runtime.GC()
	runtime.ReadMemStats(&after)
	per := float64(after.HeapAlloc-before.HeapAlloc) / n
	t.Logf("%.1f bytes per chunk in the table (%d chunks: %.1f MiB)", per, n, per*n/(1<<20))
	if per > 64 {
		t.Errorf("%.1f bytes per chunk, want at most 64", per)
	}
	runtime.KeepAlive(chunks)
	runtime.KeepAlive(tbl)
}

// TestTableBuckets: in a table large enough for buckets (Table.first),
// every id is found with its place, at the ends of the id space too, and
// ids it lacks are not, whatever bucket they fall in.
func TestTableBuckets(t *testing.T) {
	packs := testPacks(4)
	chunks := randomChunks(bucketsFrom+5000, packs, 11)
	for i, b := range [][2]byte{{0, 0}, {0, 0}, {0, 1}, {0xff, 0xfe}, {0xff, 0xff}, {0xff, 0xff}} {
		chunks[i].ID[0], chunks[i].ID[1] = b[0], b[1]
	}
	tbl := TableOf(packs, chunks)
	if tbl.first == nil {
		t.Fatal("no buckets")
	}
	for _, c := range chunks {
		if r, ok := tbl.Lookup(c.ID); !ok || r != c.Ref {
			t.Fatalf("chunk %s: %+v, %v; want %+v", c.ID, r, ok, c.Ref)
		}
		for _, flip := range []int{0, 1, 31} {
			missing := c.ID
			missing[flip] ^= 0x80
			if _, ok := tbl.Lookup(missing); ok && !slices.ContainsFunc(chunks, func(o Chunk) bool { return o.ID == missing }) {
				t.Fatalf("id %s found, not in the table", missing)
			}
		}
	}
	for _, id := range []manifest.Hash{{}, {0xff, 0xff, 0xff}, {0x80}} {
		if _, ok := tbl.Lookup(id); ok {
			t.Fatalf("id %s found, not in the table", id)
		}
	}
}

// slowOpen is a store whose reads wait a while first, and which counts
// the goroutines there are while they wait.
type slowOpen struct {
	store.Store
	mu   sync.Mutex
	most int
}

func (s *slowOpen) Open(ctx context.Context, name string, off, length int64) (io.ReadCloser, error) {
	time.Sleep(5 * time.Millisecond)
	s.mu.Lock()
	s.most = max(s.most, runtime.NumGoroutine())
	s.mu.Unlock()
	return s.Store.Open(ctx, name, off, length)
}

// TestLoadGoroutines: Load reads many index objects with a goroutine per
// read in flight, not one per object.
func TestLoadGoroutines(t *testing.T) {
	ctx := context.Background()
	st := &slowOpen{Store: mem.New("loc")}
	packs := testPacks(1)
	const objects = 300
	for i := range objects {
		if _, err := WriteIndex(ctx, st, packs, randomChunks(2, packs, uint64(i))); err != nil {
			t.Fatal(err)
		}
	}
	before := runtime.NumGoroutine()
	tbl, err := Load(ctx, st)
	if err != nil || tbl.Len() != 2*objects {
		t.Fatalf("load: %d chunks, %v", tbl.Len(), err)
	}
	if st.most > before+2*loadParallel {
		t.Errorf("%d goroutines while loading %d index objects (%d before), want at most %d more", st.most, objects, before, 2*loadParallel)
	}
}
