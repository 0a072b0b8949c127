// Package storetest is the conformance suite every store.Store passes:
// local directories, S3, and whatever comes next. A store's test calls Run
// with a function that returns a fresh, empty store.
//
// The contract it checks, beyond the interface comments:
//
//   - An object is invisible (Stat reports errdefs.ErrNotFound, List leaves
//     it out) until its writer commits, and stays invisible after Abort or
//     a failed Commit. A writer whose input failed halfway is aborted by its
//     caller and leaves nothing.
//   - Open(name, off, length) yields the bytes of [off, off+length) that
//     exist (length < 0: to the end). A range that runs past the end reads
//     short without an error from Open, and a range starting at or past
//     the end reads nothing; callers that need every byte use io.ReadFull,
//     which then reports io.ErrUnexpectedEOF. A missing object is an error
//     wrapping errdefs.ErrNotFound, from Open itself.
//   - List returns names relative to the store, sorted, filtered by a plain
//     string prefix (not a directory).
//   - Delete of a missing object succeeds. Committing over an existing
//     object replaces it.
//   - CommitNew commits only where no object of the name exists, decided
//     atomically: of writers racing to commit one name exactly one wins,
//     every other gets an error wrapping errdefs.ErrExists and leaves
//     nothing (the object holds the winner's bytes, nothing else is
//     listed), small objects and ones of several parts alike.
//   - A reader closed before its end releases its resources.
//   - A canceled context makes Commit fail and leaves nothing visible; it
//     makes Create, or else the writer's Commit, fail; and it makes Open,
//     or else the first Read, fail.
//   - Different objects can be written concurrently.
//   - An object's time (ObjectInfo.Modified) is when it was last
//     committed, by the store's clock; a lock (store.Lock) taken there is
//     kept fresh by its holder, and tells it of a lapse.
package storetest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/store"
)

// Run runs the suite. newStore returns a fresh, empty store for each
// subtest; it should register its own cleanup with t.
func Run(t *testing.T, newStore func(t *testing.T) store.Store) {
	tests := []struct {
		name string
		fn   func(t *testing.T, s store.Store)
	}{
		{"RoundTrip", testRoundTrip},
		{"Ranges", testRanges},
		{"Empty", testEmpty},
		{"Missing", testMissing},
		{"InvisibleUntilCommit", testInvisibleUntilCommit},
		{"Abort", testAbort},
		{"FailedCopyHalfway", testFailedCopy},
		{"FinishedWriter", testFinishedWriter},
		{"List", testList},
		{"Delete", testDelete},
		{"Overwrite", testOverwrite},
		{"CommitNew", testCommitNew},
		{"CommitNewRace", testCommitNewRace},
		{"InvalidNames", testInvalidNames},
		{"EarlyClose", testEarlyClose},
		{"CanceledCommit", testCanceledCommit},
		{"CanceledCreate", testCanceledCreate},
		{"CanceledOpen", testCanceledOpen},
		{"Large", testLarge},
		{"Concurrent", testConcurrent},
		{"Modified", testModified},
		{"Lock", testLock},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.fn(t, newStore(t))
		})
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// randomBytes is deterministic per seed, so failures reproduce.
func randomBytes(seed uint64, n int) []byte {
	var key [32]byte
	key[0], key[1] = byte(seed), byte(seed>>8)
	b := make([]byte, n)
	_, _ = rand.NewChaCha8(key).Read(b)
	return b
}

// put writes data in uneven pieces and commits.
func put(t *testing.T, s store.Store, name string, data []byte) {
	t.Helper()
	ctx := ctxT(t)
	w, err := s.Create(ctx, name)
	if err != nil {
		t.Fatalf("Create(%q): %v", name, err)
	}
	for rest, i := data, 0; len(rest) > 0; i++ {
		k := min(len(rest), 1+(i*7919+i*i*104729)%(3<<20))
		n, err := w.Write(rest[:k])
		if err != nil || n != k {
			_ = w.Abort(ctx)
			t.Fatalf("Write(%q): %d of %d bytes: %v", name, n, k, err)
		}
		rest = rest[k:]
	}
	if err := w.Commit(ctx); err != nil {
		t.Fatalf("Commit(%q): %v", name, err)
	}
}

func read(t *testing.T, s store.Store, name string, off, length int64) []byte {
	t.Helper()
	r, err := s.Open(ctxT(t), name, off, length)
	if err != nil {
		t.Fatalf("Open(%q, %d, %d): %v", name, off, length, err)
	}
	defer r.Close()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatalf("read %q [%d, +%d): %v", name, off, length, err)
	}
	return b
}

func mustNotExist(t *testing.T, s store.Store, name, when string) {
	t.Helper()
	ctx := ctxT(t)
	if info, err := s.Stat(ctx, name); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("%s: Stat(%q) = %+v, %v; want an error wrapping errdefs.ErrNotFound", when, name, info, err)
	}
	list, err := s.List(ctx, "")
	if err != nil {
		t.Fatalf("%s: List: %v", when, err)
	}
	for _, o := range list {
		if o.Name == name {
			t.Errorf("%s: List shows %q", when, name)
		}
	}
}

func mustHold(t *testing.T, s store.Store, name string, data []byte) {
	t.Helper()
	info, err := s.Stat(ctxT(t), name)
	if err != nil {
		t.Fatalf("Stat(%q): %v", name, err)
	}
	if info.Name != name || info.Size != int64(len(data)) {
		t.Errorf("Stat(%q) = name %q size %d; want size %d", name, info.Name, info.Size, len(data))
	}
	if d := time.Since(info.Modified); d > time.Hour || d < -time.Hour {
		t.Errorf("Stat(%q).Modified = %v, not about now", name, info.Modified)
	}
	if got := read(t, s, name, 0, -1); !bytes.Equal(got, data) {
		t.Errorf("%q reads back %d bytes (sha256 %x); want %d bytes (sha256 %x)", name, len(got), sha256.Sum256(got), len(data), sha256.Sum256(data))
	}
}

func testRoundTrip(t *testing.T, s store.Store) {
	data := randomBytes(1, 1<<20+123)
	put(t, s, "seg/00000.seg", data)
	mustHold(t, s, "seg/00000.seg", data)
	if got := read(t, s, "seg/00000.seg", 0, int64(len(data))); !bytes.Equal(got, data) {
		t.Errorf("Open with the exact length reads %d bytes, want %d", len(got), len(data))
	}
}

func testRanges(t *testing.T, s store.Store) {
	data := randomBytes(2, 200_000)
	size := int64(len(data))
	put(t, s, "obj", data)
	for _, c := range []struct {
		name        string
		off, length int64
		want        []byte
	}{
		{"first byte", 0, 1, data[:1]},
		{"head", 0, 4096, data[:4096]},
		{"middle", 12345, 54321, data[12345 : 12345+54321]},
		{"whole", 0, size, data},
		{"tail", size - 10, 10, data[size-10:]},
		{"to end", 777, -1, data[777:]},
		{"last byte to end", size - 1, -1, data[size-1:]},
		{"length 0", 100, 0, nil},
		{"length 0 at end", size, 0, nil},
		{"at end to end", size, -1, nil},
		{"at end", size, 10, nil},
		{"past end: reads short", size - 10, 100, data[size-10:]},
		{"beyond end: reads nothing", size + 10, 5, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := read(t, s, "obj", c.off, c.length)
			if !bytes.Equal(got, c.want) {
				t.Errorf("Open(%d, %d) reads %d bytes; want %d", c.off, c.length, len(got), len(c.want))
			}
		})
	}
	// What ArchiveSource does: io.ReadFull of a range that runs past the
	// end must fail, not return zeros.
	r, err := s.Open(ctxT(t), "obj", size-10, 100)
	if err != nil {
		t.Fatalf("Open past end: %v", err)
	}
	defer r.Close()
	buf := make([]byte, 100)
	if n, err := io.ReadFull(r, buf); err != io.ErrUnexpectedEOF || n != 10 {
		t.Errorf("ReadFull past the end = %d, %v; want 10, io.ErrUnexpectedEOF", n, err)
	}
}

func testEmpty(t *testing.T, s store.Store) {
	put(t, s, "empty", nil)
	mustHold(t, s, "empty", nil)
	if got := read(t, s, "empty", 0, 10); len(got) != 0 {
		t.Errorf("empty object reads %d bytes", len(got))
	}
}

func testMissing(t *testing.T, s store.Store) {
	ctx := ctxT(t)
	if _, err := s.Stat(ctx, "nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Stat(missing) = %v; want errdefs.ErrNotFound", err)
	}
	for _, l := range []int64{-1, 0, 10} {
		if r, err := s.Open(ctx, "nope", 0, l); !errors.Is(err, errdefs.ErrNotFound) {
			if r != nil {
				r.Close()
			}
			t.Errorf("Open(missing, 0, %d) = %v; want errdefs.ErrNotFound", l, err)
		}
	}
	if list, err := s.List(ctx, ""); err != nil || len(list) != 0 {
		t.Errorf("List of an empty store = %v, %v", list, err)
	}
}

func testInvisibleUntilCommit(t *testing.T, s store.Store) {
	ctx := ctxT(t)
	data := randomBytes(3, 12<<20) // several parts where parts are 5 MiB
	w, err := s.Create(ctx, "manifest.json")
	if err != nil {
		t.Fatal(err)
	}
	mustNotExist(t, s, "manifest.json", "after Create")
	if _, err := w.Write(data); err != nil {
		t.Fatal(err)
	}
	mustNotExist(t, s, "manifest.json", "after Write")
	if err := w.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	mustHold(t, s, "manifest.json", data)
}

func testAbort(t *testing.T, s store.Store) {
	ctx := ctxT(t)
	for _, size := range []int{0, 1000, 12 << 20} {
		name := fmt.Sprintf("aborted-%d", size)
		w, err := s.Create(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write(randomBytes(4, size)); err != nil {
			t.Fatal(err)
		}
		if err := w.Abort(ctx); err != nil {
			t.Errorf("Abort(%s): %v", name, err)
		}
		mustNotExist(t, s, name, "after Abort")
		if err := w.Abort(ctx); err != nil {
			t.Errorf("second Abort(%s): %v", name, err)
		}
		if err := w.Commit(ctx); err == nil {
			t.Errorf("Commit after Abort(%s) succeeded", name)
		}
		mustNotExist(t, s, name, "after Commit following Abort")
	}
}

// failingReader yields n good bytes, then an error.
type failingReader struct {
	data []byte
	err  error
}

func (r *failingReader) Read(p []byte) (int, error) {
	if len(r.data) == 0 {
		return 0, r.err
	}
	n := copy(p, r.data[:min(len(r.data), 64<<10)])
	r.data = r.data[n:]
	return n, nil
}

func testFailedCopy(t *testing.T, s store.Store) {
	ctx := ctxT(t)
	boom := errors.New("producer died")
	for _, size := range []int{1000, 11 << 20} {
		name := fmt.Sprintf("half-%d", size)
		w, err := s.Create(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		n, err := io.Copy(w, &failingReader{data: randomBytes(5, size), err: boom})
		if !errors.Is(err, boom) || n != int64(size) {
			t.Fatalf("io.Copy = %d, %v; want %d, %v", n, err, size, boom)
		}
		if err := w.Abort(ctx); err != nil {
			t.Errorf("Abort: %v", err)
		}
		mustNotExist(t, s, name, "after a failed copy and Abort")
	}
}

func testFinishedWriter(t *testing.T, s store.Store) {
	ctx := ctxT(t)
	w, err := s.Create(ctx, "once")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	if err := w.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write([]byte("more")); err == nil {
		t.Error("Write after Commit succeeded")
	}
	if err := w.Commit(ctx); err == nil {
		t.Error("second Commit succeeded")
	}
	mustHold(t, s, "once", []byte("hello"))
}

func testList(t *testing.T, s store.Store) {
	ctx := ctxT(t)
	names := []string{"b/1", "a/2", "a/10", "ab", "a/1", "a/sub/x", "c"}
	for i, n := range names {
		put(t, s, n, randomBytes(uint64(i), 10*i+1))
	}
	for _, c := range []struct {
		prefix string
		want   []string
	}{
		{"", []string{"a/1", "a/10", "a/2", "a/sub/x", "ab", "b/1", "c"}},
		{"a/", []string{"a/1", "a/10", "a/2", "a/sub/x"}},
		{"a", []string{"a/1", "a/10", "a/2", "a/sub/x", "ab"}},
		{"a/1", []string{"a/1", "a/10"}},
		{"a/sub/", []string{"a/sub/x"}},
		{"zzz", nil},
	} {
		list, err := s.List(ctx, c.prefix)
		if err != nil {
			t.Fatalf("List(%q): %v", c.prefix, err)
		}
		var got []string
		for _, o := range list {
			got = append(got, o.Name)
			i := slices.Index(names, o.Name)
			if i >= 0 && o.Size != int64(10*i+1) {
				t.Errorf("List(%q): %s has size %d, want %d", c.prefix, o.Name, o.Size, 10*i+1)
			}
		}
		if !slices.Equal(got, c.want) {
			t.Errorf("List(%q) = %q; want %q", c.prefix, got, c.want)
		}
	}
}

func testDelete(t *testing.T, s store.Store) {
	ctx := ctxT(t)
	put(t, s, "x/doomed", []byte("bye"))
	put(t, s, "x/kept", []byte("hi"))
	if err := s.Delete(ctx, "x/doomed"); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	mustNotExist(t, s, "x/doomed", "after Delete")
	if _, err := s.Open(ctx, "x/doomed", 0, -1); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Open after Delete = %v; want errdefs.ErrNotFound", err)
	}
	mustHold(t, s, "x/kept", []byte("hi"))
	if err := s.Delete(ctx, "x/doomed"); err != nil {
		t.Errorf("Delete of a deleted object: %v", err)
	}
	if err := s.Delete(ctx, "never/was"); err != nil {
		t.Errorf("Delete of a missing object: %v", err)
	}
}

func testOverwrite(t *testing.T, s store.Store) {
	long, short := randomBytes(6, 7<<20), []byte("short")
	put(t, s, "obj", long)
	put(t, s, "obj", short)
	mustHold(t, s, "obj", short)
	put(t, s, "obj", long)
	mustHold(t, s, "obj", long)
}

func testInvalidNames(t *testing.T, s store.Store) {
	ctx := ctxT(t)
	for _, name := range []string{"", "../escape", "/absolute", "a/../../b"} {
		if w, err := s.Create(ctx, name); err == nil {
			_ = w.Abort(ctx)
			t.Errorf("Create(%q) succeeded", name)
		}
	}
}

func testEarlyClose(t *testing.T, s store.Store) {
	data := randomBytes(7, 4<<20)
	put(t, s, "big", data)
	ctx := ctxT(t)
	readFew := func(off int64) {
		r, err := s.Open(ctx, "big", off, -1)
		if err != nil {
			t.Fatalf("Open: %v", err)
		}
		buf := make([]byte, 10)
		if _, err := io.ReadFull(r, buf); err != nil {
			t.Fatalf("read: %v", err)
		}
		if !bytes.Equal(buf, data[off:off+10]) {
			t.Fatalf("read at %d: wrong bytes", off)
		}
		if err := r.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	}
	readFew(0) // warm up connection pools
	runtime.GC()
	before := runtime.NumGoroutine()
	const n = 64
	for i := range n {
		readFew(int64(i) * 1000)
	}
	// Readers that held a goroutine each and never released it would show
	// as n more goroutines; allow a few for connection pools.
	deadline := time.Now().Add(10 * time.Second)
	for {
		after := runtime.NumGoroutine()
		if after <= before+n/4 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("%d goroutines before %d early-closed readers, %d after", before, n, after)
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	mustHold(t, s, "big", data)
}

func canceled() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}

func testCanceledCommit(t *testing.T, s store.Store) {
	ctx := ctxT(t)
	for _, size := range []int{100, 12 << 20} {
		name := fmt.Sprintf("canceled-%d", size)
		w, err := s.Create(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write(randomBytes(8, size)); err != nil {
			t.Fatal(err)
		}
		if err := w.Commit(canceled()); err == nil {
			t.Errorf("Commit(%s) with a canceled context succeeded", name)
		}
		if err := w.Abort(ctx); err != nil {
			t.Errorf("Abort after a failed Commit: %v", err)
		}
		mustNotExist(t, s, name, "after a canceled Commit")
	}
	// The context given to Create governs the upload too.
	cctx, cancel := context.WithCancel(ctx)
	w, err := s.Create(cctx, "create-ctx")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(randomBytes(9, 100)); err != nil {
		t.Fatal(err)
	}
	cancel()
	if err := w.Commit(cctx); err == nil {
		t.Error("Commit after its Create context was canceled succeeded")
	}
	_ = w.Abort(ctx)
	mustNotExist(t, s, "create-ctx", "after canceling Create's context")
}

func testCanceledCreate(t *testing.T, s store.Store) {
	ctx := ctxT(t)
	w, err := s.Create(canceled(), "never")
	if err == nil {
		t.Error("Create with a canceled context succeeded")
		_, _ = w.Write([]byte("data"))
		if err := w.Commit(canceled()); err == nil {
			t.Error("Commit with a canceled context succeeded")
		}
		_ = w.Abort(ctx)
	}
	mustNotExist(t, s, "never", "after Create with a canceled context")
}

func testCanceledOpen(t *testing.T, s store.Store) {
	put(t, s, "obj", randomBytes(10, 1<<20))
	r, err := s.Open(canceled(), "obj", 0, -1)
	if err != nil {
		return
	}
	defer r.Close()
	_, err = io.ReadAll(r)
	if err == nil {
		t.Error("Open with a canceled context succeeded and read the object")
	}
}

func testLarge(t *testing.T, s store.Store) {
	if testing.Short() {
		t.Skip("short mode")
	}
	data := randomBytes(11, 40<<20)
	put(t, s, "large", data)
	mustHold(t, s, "large", data)
	// Ranges across the boundaries of likely part sizes.
	for _, boundary := range []int64{5 << 20, 8 << 20, 16 << 20, 32 << 20} {
		off := boundary - 3000
		got := read(t, s, "large", off, 6000)
		if !bytes.Equal(got, data[off:off+6000]) {
			t.Errorf("range across %d MiB differs", boundary>>20)
		}
	}
}

func testConcurrent(t *testing.T, s store.Store) {
	const n = 6
	ctx := ctxT(t)
	var wg sync.WaitGroup
	errs := make([]error, n)
	datas := make([][]byte, n)
	for i := range n {
		datas[i] = randomBytes(uint64(20+i), (3<<20)+i*100_003)
		wg.Go(func() {
			name := fmt.Sprintf("con/%d", i)
			w, err := s.Create(ctx, name)
			if err != nil {
				errs[i] = err
				return
			}
			for rest := datas[i]; len(rest) > 0; {
				k := min(len(rest), 256<<10)
				if _, err := w.Write(rest[:k]); err != nil {
					errs[i] = err
					_ = w.Abort(ctx)
					return
				}
				rest = rest[k:]
			}
			errs[i] = w.Commit(ctx)
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("writer %d: %v", i, err)
		}
	}
	list, err := s.List(ctx, "con/")
	if err != nil || len(list) != n {
		t.Fatalf("List = %d objects, %v; want %d", len(list), err, n)
	}
	for i := range n {
		mustHold(t, s, fmt.Sprintf("con/%d", i), datas[i])
	}
}

// write writes data into a new writer for name, in pieces.
func write(ctx context.Context, s store.Store, name string, data []byte) (store.ObjectWriter, error) {
	w, err := s.Create(ctx, name)
	if err != nil {
		return nil, err
	}
	for rest := data; len(rest) > 0; {
		k := min(len(rest), 256<<10)
		if _, err := w.Write(rest[:k]); err != nil {
			_ = w.Abort(ctx)
			return nil, err
		}
		rest = rest[k:]
	}
	return w, nil
}

func testCommitNew(t *testing.T, s store.Store) {
	ctx := ctxT(t)
	first, second := []byte("first"), randomBytes(30, 6<<20)
	w, err := write(ctx, s, "dir/new", first)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.CommitNew(ctx); err != nil {
		t.Fatalf("CommitNew of a new name: %v", err)
	}
	mustHold(t, s, "dir/new", first)
	for _, data := range [][]byte{[]byte("small"), second} {
		w, err := write(ctx, s, "dir/new", data)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.CommitNew(ctx); !errors.Is(err, errdefs.ErrExists) {
			t.Fatalf("CommitNew of %d bytes over an existing object: %v; want errdefs.ErrExists", len(data), err)
		}
		if err := w.Abort(ctx); err != nil {
			t.Errorf("Abort after a lost CommitNew: %v", err)
		}
		mustHold(t, s, "dir/new", first)
	}
	if list, err := s.List(ctx, ""); err != nil || len(list) != 1 {
		t.Errorf("List after lost commits = %+v, %v; want the one object", list, err)
	}
	// A plain Commit still replaces; CommitNew after Delete wins again.
	put(t, s, "dir/new", second)
	mustHold(t, s, "dir/new", second)
	if err := s.Delete(ctx, "dir/new"); err != nil {
		t.Fatal(err)
	}
	if w, err = write(ctx, s, "dir/new", first); err != nil {
		t.Fatal(err)
	}
	if err := w.CommitNew(ctx); err != nil {
		t.Fatalf("CommitNew after Delete: %v", err)
	}
	mustHold(t, s, "dir/new", first)
}

// testCommitNewRace: writers that commit one name at the same moment, as
// two captures to one destination do: one wins, the others lose cleanly.
func testCommitNewRace(t *testing.T, s store.Store) {
	const n = 8
	for _, size := range []int{4 << 10, 6 << 20} { // one request; several parts
		t.Run(fmt.Sprintf("size=%d", size), func(t *testing.T) {
			ctx := ctxT(t)
			name := fmt.Sprintf("race-%d/manifest.json", size)
			datas := make([][]byte, n)
			writers := make([]store.ObjectWriter, n)
			for i := range n {
				datas[i] = randomBytes(uint64(40+i), size+i)
				w, err := write(ctx, s, name, datas[i])
				if err != nil {
					t.Fatalf("writer %d: %v", i, err)
				}
				writers[i] = w
			}
			errs := make([]error, n)
			start := make(chan struct{})
			var wg sync.WaitGroup
			for i, w := range writers {
				wg.Go(func() {
					<-start
					errs[i] = w.CommitNew(ctx)
				})
			}
			close(start)
			wg.Wait()
			winner := -1
			for i, err := range errs {
				switch {
				case err == nil && winner >= 0:
					t.Fatalf("writers %d and %d both committed %s", winner, i, name)
				case err == nil:
					winner = i
				case !errors.Is(err, errdefs.ErrExists):
					t.Errorf("writer %d: %v; want errdefs.ErrExists", i, err)
				}
			}
			if winner < 0 {
				t.Fatalf("no writer committed: %v", errs)
			}
			mustHold(t, s, name, datas[winner])
			if list, err := s.List(ctx, fmt.Sprintf("race-%d/", size)); err != nil || len(list) != 1 {
				t.Errorf("List = %+v, %v; want only %s", list, err, name)
			}
		})
	}
}
