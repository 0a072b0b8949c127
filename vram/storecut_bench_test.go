package vram

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/streamer"
)

// BenchmarkDedupSecond measures what a second --dedup checkpoint does on
// the host once the copy out has left out what did not change, the old
// flow against the new in one run, into a location on tmpfs
// (GPUCR_BENCH_DIR, default /dev/shm) through the real capture and chunk
// store: GPUCR_BENCH_MIB (default 1024) of device memory in 16 VRAM files
// of 64 MiB pieces and 64 KiB blocks, a tenth of each piece rewritten.
//
//   - old: every block of the first checkpoint read back and hashed
//     before the release (the check the old flow waited for), then each
//     file composed whole (the left-out blocks read back from the first
//     and hashed again, the kept ones hashed) through a pipe into the
//     capture, which cuts it by content and hashes it with BLAKE3;
//   - new: each file stored by its cuts: the unchanged groups by the
//     first checkpoint's chunks, the rest read from the kept copy, its
//     blocks hashed on the capture's workers.
//
// Each is measured from the start of the check (old) or the store to the
// commit. Its first checkpoint is stored by the same flow (first-s: that
// store, and for the earlier checkpoint's open, to its commit).
func BenchmarkDedupSecond(b *testing.B) {
	mib := 1024
	if v := os.Getenv("GPUCR_BENCH_MIB"); v != "" {
		fmt.Sscan(v, &mib)
	}
	root := os.Getenv("GPUCR_BENCH_DIR")
	if root == "" {
		root = "/dev/shm"
	}
	const files, piece, blk = 16, 64 << 20, 64 << 10
	r := rand.NewChaCha8([32]byte{1})
	var old, cur [][]dataPiece // by file
	skip := &skipSet{block: blk}
	per := max(1, mib/files/(piece>>20))
	for f := range files {
		var o, c []dataPiece
		for k := range per {
			va := uint64(1<<40) + uint64(f*per+k)*piece
			p, q, m := rewrittenPiece(r, va, piece, blk, func(i, n int) bool { return i >= 3*n/10 && i < 4*n/10 })
			skip.maps = append(skip.maps, m)
			o, c = append(o, p), append(c, q)
		}
		old, cur = append(old, o), append(cur, c)
	}
	oldFiles, kept := make([][]byte, files), make([][]byte, files)
	for f := range files {
		oldFiles[f], kept[f] = vramFile(old[f], nil), vramFile(cur[f], skip.has)
	}
	device := int64(files * per * piece)
	for _, flow := range []string{"old", "new"} {
		b.Run(flow, func(b *testing.B) {
			loc, err := os.MkdirTemp(root, "gpucr-bench-")
			if err != nil {
				b.Fatal(err)
			}
			defer os.RemoveAll(loc)
			st := dir.New(loc)
			start := time.Now()
			e := benchCheckpoint(b, st, "one", flow, &composer{key: 5}, oldFiles, true)
			first := time.Since(start)
			c := &composer{key: 5, skip: skip, earlier: e}
			b.SetBytes(device)
			b.ResetTimer()
			i := 0
			for b.Loop() {
				// Other bytes in the rewritten blocks each time: new
				// chunks, as the first second checkpoint makes.
				b.StopTimer()
				i++
				for f := range files {
					for k := range cur[f] {
						for j := 3 * len(cur[f][k].blocks) / 10; j < 4*len(cur[f][k].blocks)/10; j++ {
							cur[f][k].blocks[j][0] = byte(i)
						}
					}
					kept[f] = vramFile(cur[f], skip.has)
				}
				b.StartTimer()
				benchCheckpoint(b, st, fmt.Sprintf("two-%d", i), flow, c, kept, false)
			}
			b.ReportMetric(first.Seconds(), "first-s")
		})
	}
}

// benchCheckpoint stores files as checkpoint name of st by flow, composed
// by c, and commits it; with open, it returns it as an earlier one.
func benchCheckpoint(b *testing.B, st store.Store, name, flow string, c *composer, files [][]byte, open bool) *Earlier {
	ctx := context.Background()
	ckpt := store.Sub(st, name)
	out, err := streamer.NewDedupOutput(ctx, ckpt, st, 256<<20, nil)
	if err != nil {
		b.Fatal(err)
	}
	none, _ := codec.ParseSpec("none")
	opts := pipeline.Options{Codec: none}
	capt, err := streamer.NewCapture(ctx, out, opts)
	if err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	if flow == "old" && c.earlier != nil {
		if err := verifyAll(ctx, c.earlier); err != nil {
			b.Fatal(err)
		}
	}
	checked := time.Since(start)
	perFile := make([][]hashedPiece, len(files))
	errs := make([]error, len(files))
	var wg sync.WaitGroup
	for k, f := range files {
		name := fmt.Sprintf("vram-1-%02d.bin", k)
		wg.Go(func() {
			if flow == "old" {
				pr, pw := io.Pipe()
				go func() {
					ps, err := c.compose(ctx, k, bytes.NewReader(f), int64(len(f)), pw)
					perFile[k] = ps
					pw.CloseWithError(err)
				}()
				_, errs[k] = capt.WriteFile(name, pr, true)
				return
			}
			fc := newFileCuts(ctx, c, k, bytes.NewReader(f), int64(len(f)), &CutPut{Knows: capt.Knows, ChunkSize: capt.ChunkSize()})
			_, errs[k] = capt.WriteCuts(name, func(yield func(streamer.Cut, error) bool) {
				for cut, err := range fc.all {
					if !yield(streamer.Cut(cut), err) {
						return
					}
				}
			})
			if errs[k] == nil {
				errs[k] = fc.check()
			}
			perFile[k] = fc.hashed()
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		b.Fatal(err)
	}
	hb, _ := newBlockHashes(c.key, len(files), perFile).MarshalBinary()
	if _, err := capt.WriteFile("vram-1.hashes", bytes.NewReader(hb), true); err != nil {
		b.Fatal(err)
	}
	m, err := capt.Close(ctx, manifest.Manifest{})
	if err != nil {
		b.Fatal(err)
	}
	if c.earlier != nil {
		b.ReportMetric(checked.Seconds(), "check-s/op")
		b.ReportMetric(float64(m.Stats.NewStoredBytes)/(1<<20), "new-MiB/op")
	}
	if !open {
		return nil
	}
	a, err := source.OpenArchive(ctx, ckpt, opts)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { a.Close() })
	h, _ := ParseBlockHashes(hb)
	e := &Earlier{Name: name, Hashes: h, Open: func(ctx context.Context, name string) (io.ReaderAt, error) {
		r, _, err := a.ReaderAt(ctx, name)
		return r, err
	}}
	for k := range files {
		f, _ := a.Stat(ctx, fmt.Sprintf("vram-1-%02d.bin", k))
		e.Files, e.Chunks = append(e.Files, f.Name), append(e.Chunks, f.Chunks)
	}
	return e
}

// verifyAll is the old flow's check of an earlier checkpoint before the
// release: every block it stores read back and hashed, a goroutine a file.
func verifyAll(ctx context.Context, e *Earlier) error {
	byFile := make([][]*hashedPiece, e.Hashes.Files)
	for i := range e.Hashes.pieces {
		p := &e.Hashes.pieces[i]
		byFile[p.file] = append(byFile[p.file], p)
	}
	errs := make([]error, len(byFile))
	var wg sync.WaitGroup
	for f, ps := range byFile {
		wg.Go(func() {
			r, err := e.Open(ctx, e.Files[f])
			if err != nil {
				errs[f] = err
				return
			}
			buf := make([]byte, copyBuf)
			for _, p := range ps {
				per := uint64(len(buf)) / p.block
				for b := uint64(0); b < p.nblk(); b += per {
					if _, err := e.readRun(r, p, b, min(per, p.nblk()-b), buf); err != nil {
						errs[f] = err
						return
					}
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// BenchmarkStoreCutsBlocks measures what a --dedup store's bookkeeping of
// blocks costs beside the bytes it moves, at 4 KiB and 64 KiB blocks:
// GPUCR_BENCH_MIB (default 128) of device memory in 64 MiB pieces, every
// tenth block rewritten (so every group mixes kept and left-out blocks and
// is stored by its bytes), the rest left out and read back from an earlier
// checkpoint in memory, every block hashed, through a plain put (one
// goroutine, no chunk store).
func BenchmarkStoreCutsBlocks(b *testing.B) {
	mib := 128
	if v := os.Getenv("GPUCR_BENCH_MIB"); v != "" {
		fmt.Sscan(v, &mib)
	}
	const piece = 64 << 20
	for _, blk := range []int{4 << 10, 64 << 10} {
		b.Run(fmt.Sprintf("block=%dKiB", blk>>10), func(b *testing.B) {
			r := rand.NewChaCha8([32]byte{2})
			var old, cur []dataPiece
			skip := &skipSet{block: uint64(blk)}
			for k := range max(1, mib/(piece>>20)) {
				va := uint64(1<<40) + uint64(k)*piece
				p, q, m := rewrittenPiece(r, va, piece, blk, func(i, _ int) bool { return i%10 == 3 })
				skip.maps = append(skip.maps, m)
				old, cur = append(old, p), append(cur, q)
			}
			oldFile, kept := vramFile(old, nil), vramFile(cur, skip.has)
			ps, err := storeCuts(&composer{key: 5}, oldFile, nil, "one")
			if err != nil {
				b.Fatal(err)
			}
			c := &composer{key: 5, skip: skip, earlier: memEarlier(newBlockHashes(5, 1, [][]hashedPiece{ps}), oldFile)}
			b.SetBytes(int64(len(cur) * piece))
			for b.Loop() {
				if _, err := storeCuts(c, kept, nil, "two"); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// rewrittenPiece is a piece of random blocks at va (old) and the same
// piece with the blocks rewritten says rewritten anew (cur), and the
// device's record of the blocks left unchanged (m).
func rewrittenPiece(r *rand.ChaCha8, va uint64, piece, blk int, rewritten func(i, n int) bool) (old, cur dataPiece, m devMap) {
	old = dataPiece{va: va, block: uint64(blk)}
	for range piece / blk {
		bl := make([]byte, blk)
		r.Read(bl)
		old.blocks = append(old.blocks, bl)
	}
	cur = dataPiece{va: va, block: uint64(blk), blocks: append([][]byte(nil), old.blocks...)}
	m = devMap{va: va, size: uint64(piece), bits: make([]byte, piece/blk/8)}
	for i := range cur.blocks {
		if rewritten(i, len(cur.blocks)) {
			cur.blocks[i] = make([]byte, blk)
			r.Read(cur.blocks[i])
		} else {
			m.bits[i/8] |= 1 << (i % 8)
		}
	}
	return old, cur, m
}
