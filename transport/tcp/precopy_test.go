package tcp

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/streamer"
	"github.com/gpucr/gpucr-stream/transport/tcp/wire"
)

// TestPrecopyRoundTrip sends a round of chunks ahead, changes a little of
// the image, and sends the stream with references: the receiver serves
// the changed image, the stream sent most of it by reference, and the
// cache spills beyond its memory without changing what is served.
func TestPrecopyRoundTrip(t *testing.T) {
	for _, c := range []struct {
		streams int
		cache   int64
	}{{1, 64 << 20}, {3, 64 << 20}, {2, 64 << 10}} { // the last spills all its large chunks
		t.Run(fmt.Sprintf("streams=%d,cache=%d", c.streams, c.cache), func(t *testing.T) {
			l, err := Listen(testCtx(t), "127.0.0.1:0", ListenOptions{Auth: tokenAuth(goodToken), Timeout: 3 * time.Second, Reports: true,
				ChunkCache: true, CacheMemory: c.cache, SpillDir: t.TempDir()})
			if err != nil {
				t.Fatal(err)
			}
			src := NewSource(testCtx(t), l, source.StreamSourceOptions{Options: pipeline.Options{MemoryLimit: 8 << 20}, SpillDir: t.TempDir()})
			defer src.Close()
			out, err := Dial(testCtx(t), l.Addr().String(), SendOptions{Auth: tokenAuth(goodToken), Streams: c.streams, Timeout: 3 * time.Second,
				Format: pipeline.Format{ChunkHashes: true}})
			if err != nil {
				t.Fatal(err)
			}
			defer out.Close()
			if !out.Receiver().ChunkCache {
				t.Fatal("the receiver does not announce its chunk cache")
			}
			files := testFiles()
			ahead := &AheadOutput{Out: out}
			if err := send(t, ahead, files); err != nil {
				t.Fatalf("pre-copy round: %v", err)
			}
			if ahead.Chunks < 3 || ahead.Sent < 3<<20 {
				t.Fatalf("the round sent %d chunks, %d bytes", ahead.Chunks, ahead.Sent)
			}
			// The receiver counts them as they arrive (its progress shows
			// them while the stream's counters are still at 0).
			wait := testCtx(t)
			for src.Session() == nil || src.Session().AheadBytes() < ahead.Sent {
				select {
				case <-wait.Done():
					t.Fatalf("the receiver counts %d bytes sent ahead, the round sent %d", src.Session().AheadBytes(), ahead.Sent)
				case <-time.After(5 * time.Millisecond):
				}
			}
			if raw := src.Counters().RawBytes.Load(); raw != 0 {
				t.Errorf("the stream's counters count %d raw bytes before the stream", raw)
			}
			// What changed meanwhile: 4 KiB in the middle of the random part.
			rand.Read(files["pages-1.img"][2<<20 : 2<<20+4096])
			before := out.WireBytes()
			if err := send(t, RefOutput{Output: out, Skip: true}, files); err != nil {
				t.Fatalf("final stream: %v", err)
			}
			final := out.WireBytes() - before
			if err := out.Confirm(testCtx(t), CommitInfo{}); err != nil {
				t.Fatal(err)
			}
			if _, err := src.WaitCommitted(testCtx(t)); err != nil {
				t.Fatal(err)
			}
			checkFiles(t, src, files)
			if out.RefBytes() < 2<<20 || final > ahead.Sent/2 {
				t.Errorf("final stream: %d bytes on the wire, %d by reference; the round sent %d", final, out.RefBytes(), ahead.Sent)
			}
			s := src.Session()
			if s.CacheChunks != int(ahead.Chunks) || s.CacheBytes != ahead.Sent {
				t.Errorf("the receiver cached %d chunks, %d bytes; sent %d, %d", s.CacheChunks, s.CacheBytes, ahead.Chunks, ahead.Sent)
			}
			if s.cache.chunks != nil || s.cache.spill != nil {
				t.Error("the cache is not freed once the stream is read")
			}
		})
	}
}

// TestChunkCache: a REF is resolved from memory or the spill file, waits
// for a chunk another connection has not delivered yet, and is refused,
// naming the chunk, when the cache does not hold it (or not as named).
func TestChunkCache(t *testing.T) {
	stored := []byte("stored bytes of the chunk")
	id := [32]byte{0xab, 0xcd}
	chunk := wire.Chunk{Codec: 2, RawLen: 4096, CRC: 0x1234, ID: id, Stored: stored}
	hdr := func(id [32]byte, codec uint8, storedLen uint32) []byte {
		b := make([]byte, manifest.FrameSize)
		fh := manifest.FrameHeader{Type: manifest.FrameData, Codec: codec, FileID: 3, Offset: 8192, RawLen: 4096, StoredLen: storedLen, Checksum: 0x1234, Hash: id}
		fh.Marshal(b)
		return b
	}
	good := hdr(id, 2, uint32(len(stored)))
	for _, c := range []struct {
		name    string
		limit   int64
		ref     []byte
		wantErr string
	}{
		{"memory", 1 << 20, good, ""},
		{"spilled", chunkRecord, good, ""}, // its record fits, its bytes do not
		{"unknown", 1 << 20, hdr([32]byte{0xee}, 2, uint32(len(stored))), "names chunk ee00"},
		{"other codec", 1 << 20, hdr(id, 3, uint32(len(stored))), "the cache holds 4096 in codec 2"},
		{"other length", 1 << 20, hdr(id, 2, 3), "the cache holds"},
		{"bad header", 1 << 20, append(good[:60:60], 0, 0, 0, 0), "frame header checksum"},
	} {
		t.Run(c.name, func(t *testing.T) {
			k := newChunkCache(c.limit, t.TempDir(), 1)
			defer k.close()
			if err := k.put(chunk); err != nil {
				t.Fatal(err)
			}
			k.begin()
			b, lendable, err := k.payload(c.ref)
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) || !errors.Is(err, errdefs.ErrCorrupt) {
					t.Fatalf("payload: %v, want an error with %q", err, c.wantErr)
				}
				return
			}
			if err != nil || !bytes.Equal(b, stored) || lendable != (c.limit >= 1<<20) {
				t.Fatalf("payload: %q, lendable %v, %v", b, lendable, err)
			}
		})
	}
	t.Run("waits for another connection", func(t *testing.T) {
		k := newChunkCache(1<<20, t.TempDir(), 2)
		defer k.close()
		k.begin() // this connection's stream began; the other's has not
		got := make(chan error, 1)
		go func() {
			_, _, err := k.payload(good)
			got <- err
		}()
		select {
		case err := <-got:
			t.Fatalf("payload did not wait for the other connection: %v", err)
		case <-time.After(50 * time.Millisecond):
		}
		if err := k.put(chunk); err != nil {
			t.Fatal(err)
		}
		if err := <-got; err != nil {
			t.Fatal(err)
		}
		go func() {
			_, _, err := k.payload(hdr([32]byte{7}, 2, 5))
			got <- err
		}()
		k.begin() // the other began too: a chunk not held now never comes
		if err := <-got; err == nil {
			t.Fatal("a chunk never sent was resolved")
		}
	})
	t.Run("closed", func(t *testing.T) {
		k := newChunkCache(1<<20, t.TempDir(), 2)
		got := make(chan error, 1)
		go func() {
			_, _, err := k.payload(good)
			got <- err
		}()
		k.close()
		if err := <-got; err == nil {
			t.Fatal("payload resolved from a closed cache")
		}
		if err := k.put(chunk); err == nil {
			t.Fatal("put into a closed cache")
		}
	})
}

// TestPrecopyOlderReceiver: a receiver without a cache is not sent chunks.
func TestPrecopyOlderReceiver(t *testing.T) {
	r := startReceiver(t, tokenAuth(goodToken))
	out, err := Dial(testCtx(t), r.addr(), SendOptions{Auth: tokenAuth(goodToken), Timeout: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if err := out.SendChunk(context.Background(), wire.Chunk{RawLen: 1, Stored: []byte{1}}); err == nil {
		t.Fatal("a chunk was sent to a receiver without a cache")
	}
}

// TestPrecopyKeepAlive: a sender that sends nothing but keepalives for
// several of the receiver's timeouts (a round of chunks the receiver
// holds) is not dropped, and its keepalives do not begin the stream: a
// REF still waits for every connection's chunks.
func TestPrecopyKeepAlive(t *testing.T) {
	const timeout = time.Second
	l, err := Listen(testCtx(t), "127.0.0.1:0", ListenOptions{Auth: tokenAuth(goodToken), Timeout: timeout, Reports: true,
		ChunkCache: true, CacheMemory: 1 << 20, SpillDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	src := NewSource(testCtx(t), l, source.StreamSourceOptions{Options: pipeline.Options{MemoryLimit: 8 << 20}, SpillDir: t.TempDir()})
	defer src.Close()
	out, err := Dial(testCtx(t), l.Addr().String(), SendOptions{Auth: tokenAuth(goodToken), Streams: 2, Timeout: timeout,
		Format: pipeline.Format{ChunkHashes: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	files := testFiles()
	if err := send(t, &AheadOutput{Out: out}, files); err != nil {
		t.Fatal(err)
	}
	for range 12 { // 4 timeouts
		time.Sleep(timeout / 3)
		out.KeepAlive()
	}
	if err := send(t, RefOutput{Output: out, Skip: true}, files); err != nil {
		t.Fatalf("after the keepalives: %v", err)
	}
	if err := out.Confirm(testCtx(t), CommitInfo{}); err != nil {
		t.Fatal(err)
	}
	if _, err := src.WaitCommitted(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	checkFiles(t, src, files)
	if out.RefBytes() == 0 {
		t.Error("nothing went by reference")
	}
}

// TestPrecopyWithCopy: the final stream teed with a local copy (migrate's
// kept image) sends the chunks the receiver has by reference while the
// copy gets every byte, those chunks stored raw rather than encoded; both
// read back whole.
func TestPrecopyWithCopy(t *testing.T) {
	l, err := Listen(testCtx(t), "127.0.0.1:0", ListenOptions{Auth: tokenAuth(goodToken), Timeout: 3 * time.Second, Reports: true,
		ChunkCache: true, CacheMemory: 64 << 20, SpillDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	src := NewSource(testCtx(t), l, source.StreamSourceOptions{Options: pipeline.Options{MemoryLimit: 8 << 20}, SpillDir: t.TempDir()})
	defer src.Close()
	out, err := Dial(testCtx(t), l.Addr().String(), SendOptions{Auth: tokenAuth(goodToken), Streams: 2, Timeout: 3 * time.Second,
		Format: pipeline.Format{ChunkHashes: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	files := testFiles()
	files["text.img"] = bytes.Repeat([]byte("compressible text "), 200000) // lz4 in the round, raw in the copy
	if err := send(t, &AheadOutput{Out: out}, files); err != nil {
		t.Fatal(err)
	}
	rand.Read(files["pages-1.img"][1<<20 : 1<<20+4096])
	var copyBuf bytes.Buffer
	keep, err := streamer.NewStreamOutputAs([]io.Writer{&copyBuf}, out.Format())
	if err != nil {
		t.Fatal(err)
	}
	if err := send(t, streamer.TeeOutput{Primary: RefOutput{Output: out}, Copy: keep}, files); err != nil {
		t.Fatalf("final stream: %v", err)
	}
	if err := out.Confirm(testCtx(t), CommitInfo{}); err != nil {
		t.Fatal(err)
	}
	if _, err := src.WaitCommitted(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	checkFiles(t, src, files)
	if out.RefBytes() < 2<<20 {
		t.Errorf("%d bytes by reference", out.RefBytes())
	}
	kept := source.NewStreamSource(testCtx(t), []io.Reader{bytes.NewReader(copyBuf.Bytes())}, []string{"copy"}, source.StreamSourceOptions{})
	defer kept.Close()
	checkFiles(t, kept, files)
	// The copy holds the text raw: the receiver had it, so not encoded again.
	if n := int64(copyBuf.Len()); n < int64(len(files["text.img"])) {
		t.Errorf("the copy is %d bytes: the text the receiver had was encoded for it", n)
	}
}

// TestChunkCacheSlabs: CHUNK records are read into slabs while the budget
// has room for one, are kept there (counted once, with their slab) and
// resolved as the slab's own bytes; a chunk too large for a slab, or one
// beyond the budget, gets memory of its own, kept or spilled as before.
func TestChunkCacheSlabs(t *testing.T) {
	hdr := func(c wire.Chunk) []byte {
		b := make([]byte, manifest.FrameSize)
		fh := manifest.FrameHeader{Type: manifest.FrameData, Codec: c.Codec, RawLen: c.RawLen, StoredLen: uint32(len(c.Stored)), Checksum: c.CRC, Hash: c.ID}
		fh.Marshal(b)
		return b
	}
	// Chunk bytes may take one slab, one chunk of its own and the records.
	data := int64(slabSize + maxSlabChunk + 1 + 10*chunkRecord)
	limit := data
	for limit-limit/8 < data {
		limit++
	}
	k := newChunkCache(limit, t.TempDir(), 1)
	defer k.close()
	k.begin()
	var chunks []wire.Chunk
	add := func(n int, wantSlab bool) {
		t.Helper()
		p := k.alloc(wire.ChunkFixed + n)
		if len(p) != wire.ChunkFixed+n {
			t.Fatalf("alloc(%d) gave %d bytes", wire.ChunkFixed+n, len(p))
		}
		if got := k.inSlab(p); got != wantSlab {
			t.Fatalf("chunk %d of %d bytes in a slab: %v, want %v", len(chunks), n, got, wantSlab)
		}
		rand.Read(p[wire.ChunkFixed:])
		c := wire.Chunk{Codec: 0, RawLen: uint32(n), CRC: uint32(len(chunks)), Stored: p[wire.ChunkFixed:]}
		c.ID[0], c.ID[1] = byte(len(chunks)), byte(len(chunks)>>8)
		if err := k.put(c); err != nil {
			t.Fatal(err)
		}
		chunks = append(chunks, c)
	}
	for range 7 {
		add(maxSlabChunk-wire.ChunkFixed, true) // 7 of 8 fill most of the first slab
	}
	if want := slabSize + 7*chunkRecord; k.mem != want {
		t.Fatalf("after one slab's chunks the cache counts %d bytes, want %d (the slab and 7 records)", k.mem, want)
	}
	add(maxSlabChunk+1, false)              // too large for a slab: its own, counted
	add(maxSlabChunk-wire.ChunkFixed, true) // the last that fits the first slab
	add(4096, false)                        // no room for a second slab in the budget: its own, spilled
	if k.spill == nil || k.spilled != 4096 {
		t.Fatalf("spilled %d bytes, want the last chunk's 4096", k.spilled)
	}
	for i, c := range chunks {
		b, lendable, err := k.payload(hdr(c))
		if err != nil || !bytes.Equal(b, c.Stored) {
			t.Fatalf("chunk %d: %v", i, err)
		}
		if lendable != (i < len(chunks)-1) || lendable && &b[0] != &c.Stored[0] {
			t.Fatalf("chunk %d: lendable %v (the cache's own bytes: %v)", i, lendable, lendable && &b[0] == &c.Stored[0])
		}
	}
}

// Every chunk's record counts against the cache's budget at no less than
// what it takes of the heap, and records past the limit fail the stream
// (a million small chunks held 157 MiB over a 1 MiB limit).
func TestChunkCacheRecordsCounted(t *testing.T) {
	const n = 100000
	chunk := func(i int) wire.Chunk {
		c := wire.Chunk{RawLen: 8, Stored: make([]byte, 8)}
		binary.LittleEndian.PutUint64(c.ID[:], uint64(i))
		return c
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	k := newChunkCache(1<<30, t.TempDir(), 1)
	for i := range n {
		if err := k.put(chunk(i)); err != nil {
			t.Fatal(err)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	heap := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("%d chunks of 8 bytes: %d bytes counted, the heap grew by %d", n, k.mem, heap)
	if k.mem < heap {
		t.Errorf("%d chunks of 8 bytes counted as %d bytes; they took %d of the heap", n, k.mem, heap)
	}
	k.close()

	k = newChunkCache(1<<20, t.TempDir(), 1)
	defer k.close()
	for i := range n {
		err := k.put(chunk(i))
		if err == nil {
			continue
		}
		if !errors.Is(err, source.ErrMemoryLimit) || !strings.Contains(err.Error(), "--memory-limit") {
			t.Fatalf("chunk %d: %v, want ErrMemoryLimit naming --memory-limit", i, err)
		}
		if k.mem > 1<<20 {
			t.Fatalf("the cache counts %d bytes over its limit of %d", k.mem, 1<<20)
		}
		return
	}
	t.Fatalf("a cache of 1 MiB took the records of %d chunks", n)
}

// The cache checks the spill directory's free space before it writes, and
// fails clearly when it would fill it.
func TestChunkCacheSpillSpace(t *testing.T) {
	k := newChunkCache(chunkRecord*16, t.TempDir(), 1)
	defer k.close()
	const free = 3 << 20
	k.room = func(f *os.File, n int64) error {
		fi, err := f.Stat()
		if err != nil {
			return err
		}
		if fi.Size()+n > free {
			return fmt.Errorf("%s: %d more bytes: %w", f.Name(), n, source.ErrNoSpace)
		}
		return nil
	}
	for i := range 8 {
		c := wire.Chunk{RawLen: 1 << 20, Stored: make([]byte, 1<<20)}
		c.ID[0] = byte(i)
		err := k.put(c)
		if i < 3 {
			if err != nil {
				t.Fatalf("chunk %d: %v", i, err)
			}
			continue
		}
		if !errors.Is(err, source.ErrNoSpace) || !strings.Contains(err.Error(), "chunk cache: spill") {
			t.Fatalf("chunk %d: %v, want ErrNoSpace", i, err)
		}
		if k.spilled != free {
			t.Fatalf("spilled %d bytes, want %d", k.spilled, free)
		}
		return
	}
	t.Fatal("the spill directory was filled")
}
