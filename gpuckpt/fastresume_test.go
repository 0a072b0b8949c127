package gpuckpt

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/vram"
	"github.com/gpucr/gpucr-stream/vram/vramtest"
)

// The restore of the fast path's files (vram.FastResume) on what the
// table moved out: the library's checks of every file, and a failed
// restore leaving the process parked.

// A failed copy-in (or remap) on restore leaves the process parked; a
// retry completes it.
func TestFastResumeFaults(t *testing.T) {
	ctx := context.Background()
	for _, fault := range []string{"remap", "copyin"} {
		t.Run(fault, func(t *testing.T) {
			tg := vramtest.Start(t, "GPUCR_PRELOAD_FAULT="+fault)
			st, s := fastSuspended(t, tg, false)
			files := s.fast.Procs()[0].Files
			if _, err := vram.FastResume(ctx, tg.SockDir, tg.PID, files, st.Get, nil, nil); err == nil || !strings.Contains(err.Error(), "injected") {
				t.Fatalf("resume with a %s fault: %v", fault, err)
			}
			if r := tg.Check(t, 200*time.Millisecond); r != "" {
				t.Fatalf("the target ran after a failed resume: %q", r)
			}
			if _, err := vram.FastResume(ctx, tg.SockDir, tg.PID, files, st.Get, nil, nil); err != nil {
				t.Fatal(err)
			}
			tg.MustBeIntact(t)
		})
	}
}

// Copy-in takes only well-formed files whose ranges are mappings of the
// process; anything else fails and the process stays parked.
func TestFastResumeBadFiles(t *testing.T) {
	ctx := context.Background()
	tg := vramtest.Start(t)
	st, s := fastSuspended(t, tg, false)
	files := s.fast.Procs()[0].Files
	good := map[string][]byte{}
	for k, v := range st.Files {
		good[k] = v
	}
	// The file with the most ranges.
	f0 := files[0]
	for _, f := range files {
		if len(good[f]) > len(good[f0]) {
			f0 = f
		}
	}
	g0 := good[f0]
	rs := vramtest.ParseRecords(t, f0, g0)
	r0 := rs[0]
	// rd is the first record with data; rz its header's end (bitmap
	// included), where its padding starts.
	rd := rs[slices.IndexFunc(rs, func(r vramtest.Record) bool { return r.Data > 0 })]
	rz := r0.Off - 4096 + 8 + 32 + len(r0.Unstored)
	if r0.Off != 4096 {
		t.Fatalf("first record's data at %d, want 4096", r0.Off)
	}
	// one is a file of one GPUCRVM3 record of r0 (the others missing).
	one := func(block, cached uint64, bm []byte) []byte {
		return append(v3rec([]byte("GPUCRVM3"), r0, block, cached, bm, nil), make([]byte, 32)...)
	}
	// The first piece again before the end record.
	twice := v3rec(append([]byte{}, g0[:len(g0)-32]...), r0, r0.Block, r0.Cached, []byte(r0.Unstored), g0[r0.Off:r0.Off+r0.Data])
	twice = append(twice, make([]byte, 32)...)
	padded := append([]byte{}, g0...)
	padded[rz] = 1
	// The same file as GPUCRVM2 and GPUCRVM1 (every byte): still read.
	v1, v2 := olderFormats(g0, rs)
	// Blocks of 3 x 64 KiB leave spare bits in the last byte of the
	// bitmap: one set marks a block past the piece.
	wide := uint64(3 << 16)
	beyond := make([]byte, ((r0.N+wide-1)/wide+7)/8)
	beyond[len(beyond)-1] = 0x80
	all := make([]byte, len(r0.Unstored)) // every block left out
	for k := uint64(0); k*r0.Block < r0.N; k++ {
		all[k/8] |= 1 << (k % 8)
	}
	for _, tc := range []struct {
		name string
		data []byte
		want string
	}{
		{"bad magic", []byte("GPUCRVM4"), "bad magic"},
		{"empty", nil, "truncated header"},
		{"no end record", []byte("GPUCRVM1"), "no end record"},
		{"outside the mappings", append(append([]byte("GPUCRVM1"), rec(4096, 8)...), make([]byte, 8)...), "not a mapping"},
		{"wraps around", append([]byte("GPUCRVM1"), rec(tg.Regions[0].VA, 1<<63)...), "not a mapping"},
		{"truncated header", g0[:8+20], "no end record"},
		{"truncated bitmap", g0[:8+32], "truncated in the bitmap"},
		{"truncated padding", g0[:rz+3], fmt.Sprintf("truncated at offset %d", rz)},
		{"padding not zero", padded, fmt.Sprintf("byte %d is not zero", rz)},
		{"truncated range", g0[:rd.Off+3], "truncated in range"},
		{"not a piece", append(append([]byte("GPUCRVM1"), rec(tg.Regions[0].VA, 4096)...), make([]byte, 4096)...), "not one of its pieces"},
		{"a piece missing", append([]byte("GPUCRVM1"), rec(0, 0)...), "missing"},
		{"a piece twice", twice, "came twice"},
		{"block not pages", one(4097, 0, []byte(r0.Unstored)), "block size 4097"},
		{"block zero", one(0, 0, nil), "block size 0"},
		{"bitmap beyond the blocks", one(wide, 0, beyond), "the bitmap marks block"},
		{"more cached than left out", one(r0.Block, r0.N+1, all), "more than the"},
		{"data short of the bitmap", one(r0.Block, 0, make([]byte, len(r0.Unstored))), "truncated in range"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range good {
				st.Files[k] = v
			}
			st.Files[f0] = tc.data
			if _, err := vram.FastResume(ctx, tg.SockDir, tg.PID, files, st.Get, nil, nil); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("resume: %v, want %q", err, tc.want)
			}
			if r := tg.Report(t); !r.Parked {
				t.Fatalf("not parked after a bad file: %+v", r)
			}
		})
	}
	for k, v := range good {
		st.Files[k] = v
	}
	for _, old := range [][]byte{v1, v2} {
		st.Files[f0] = old
		if _, err := vram.FastResume(ctx, tg.SockDir, tg.PID, files, st.Get, nil, nil); err != nil {
			t.Fatalf("resume with one file in %s: %v", old[:8], err)
		}
		tg.MustBeIntact(t)
		st2, s2 := fastSuspended(t, tg, false)
		st.Files, files = st2.Files, s2.fast.Procs()[0].Files
	}
}

// rec is a record header of GPUCRVM1 and 2: va and size.
func rec(va, n uint64) []byte {
	b := binary.LittleEndian.AppendUint64(nil, va)
	return binary.LittleEndian.AppendUint64(b, n)
}

// v3rec appends to f a GPUCRVM3 record of r with the block, cached and
// bitmap given, padded to a page, and data.
func v3rec(f []byte, r vramtest.Record, block, cached uint64, bm []byte, data []byte) []byte {
	f = append(append(append(f, rec(r.VA, r.N)...), rec(block, cached)...), bm...)
	return append(append(f, make([]byte, (4096-len(f)%4096)%4096)...), data...)
}

// olderFormats are the GPUCRVM3 file g0 (records rs) as GPUCRVM1 and
// GPUCRVM2: every byte of each piece stored.
func olderFormats(g0 []byte, rs []vramtest.Record) (v1, v2 []byte) {
	v1, v2 = []byte("GPUCRVM1"), []byte("GPUCRVM2")
	for _, r := range rs {
		v1 = append(append(v1, rec(r.VA, r.N)...), vramtest.PieceBytes(g0, r)...)
		v2 = append(v2, rec(r.VA, r.N)...)
		v2 = append(append(v2, make([]byte, 4096-len(v2)%4096)...), vramtest.PieceBytes(g0, r)...)
	}
	return append(v1, rec(0, 0)...), append(v2, rec(0, 0)...)
}

// FuzzCopyIn feeds arbitrary bytes to the library's VRAM file reader, as
// one of a process's files on restore (the others good): it must refuse
// anything that does not cover every piece exactly once, and leave the
// process parked, never crash it.
func FuzzCopyIn(f *testing.F) {
	ctx := context.Background()
	tg := vramtest.Start(f)
	st, s := fastSuspended(f, tg, false)
	files := s.fast.Procs()[0].Files
	g0 := st.Files[files[0]]
	f.Add(g0)
	f.Add([]byte("GPUCRVM1"))
	f.Add(append([]byte("GPUCRVM1"), make([]byte, 16)...))
	f.Add(append([]byte("GPUCRVM2"), make([]byte, 16)...))
	f.Add(append([]byte("GPUCRVM3"), make([]byte, 32)...))
	if rs := vramtest.ParseRecords(f, files[0], g0); len(rs) > 0 {
		// The first record alone, its data cut short.
		f.Add(g0[:rs[0].Off+rs[0].Data/2])
	}
	if len(g0) > 40 {
		f.Add(g0[:40])
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		get := func(ctx context.Context, name string, w io.Writer) error {
			if name == files[0] {
				_, err := w.Write(data)
				return err
			}
			return st.Get(ctx, name, w)
		}
		_, err := vram.FastResume(ctx, tg.SockDir, tg.PID, files, get, nil, nil)
		if err == nil {
			// It covered everything: move the memory out again for the
			// next input.
			if !bytes.Equal(data, st.Files[files[0]]) {
				t.Logf("accepted %d bytes that are not the file written", len(data))
			}
			tg.MustBeIntact(t)
			st2 := vramtest.NewStore()
			s, err := moveOut(ctx, []int{tg.PID}, st2.Put, fastOpts(tg, t))
			if err != nil {
				t.Fatal(err)
			}
			s.FastCommit()
			st.Files = st2.Files
			return
		}
		if r := tg.Report(t); !r.Parked || !r.Unfilled {
			t.Fatalf("after a refused copy-in (%v): %+v, want parked and unfilled", err, r)
		}
		// Nothing lets the program run on memory that was not refilled.
		p, err := preloadctl.Dial(ctx, tg.SockDir, tg.PID)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		if err := p.Unpark(ctx); err == nil || !strings.Contains(err.Error(), "not refilled") {
			t.Fatalf("unpark after a refused copy-in: %v", err)
		}
	})
}
