package gpuckpt

import (
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/vram"
	"github.com/gpucr/gpucr-stream/vram/vramtest"
)

// The fill (fill.go, preload/fill.c) against the fake driver: a filler
// process fills the memory of a process whose memory is released, the
// process adopts it, and no copy in runs; a table that is not the
// process's is refused and the copy in does the work.

// runFillerIfAsked makes this test binary a filler when a test starts it
// as one (fillerCommand).
func runFillerIfAsked() {
	lib := os.Getenv("GPUCR_TEST_FILLER_DIR")
	if lib == "" {
		return
	}
	err := preloadctl.RunFiller(3, filepath.Join(lib, preloadctl.Library), filepath.Join(lib, "lib", "libcuda.so.1"))
	if err != nil {
		os.Stderr.WriteString(err.Error() + "\n")
		os.Exit(1)
	}
	os.Exit(0)
}

// storeSource is a checkpoint of the files of a vramtest.Store.
type storeSource struct {
	source.Source
	st *vramtest.Store
}

func (s storeSource) Copy(ctx context.Context, name string, w io.Writer) (int64, error) {
	var b bytes.Buffer
	if err := s.st.Get(ctx, name, &b); err != nil {
		return 0, err
	}
	return io.Copy(w, &b)
}

// useTestFiller has fill.go start this test binary as the filler.
func useTestFiller(t testing.TB) {
	t.Setenv("GPUCR_FILL", "1")
	dir := vramtest.Build(t)
	old := fillerCommand
	fillerCommand = func() (*exec.Cmd, error) {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "GPUCR_TEST_FILLER_DIR="+dir)
		return cmd, nil
	}
	t.Cleanup(func() { fillerCommand = old })
}

// suspendedForFill is a target whose memory the fast path moved out into
// st (its handle table too), as the checkpoint records it.
func suspendedForFill(t *testing.T) (*vramtest.Target, *vramtest.Store, vram.FastProc, []manifest.CUDAProcess) {
	t.Helper()
	tg := vramtest.Start(t)
	st, s := fastSuspended(t, tg, false)
	p := s.fast.Procs()[0]
	if p.Handles == "" || len(st.Tables[p.Handles]) == 0 {
		t.Fatalf("no handle table stored: %+v", p)
	}
	return tg, st, p, []manifest.CUDAProcess{{PID: p.PID, Path: manifest.CUDAPathPreload, Files: p.Files, Handles: p.Handles}}
}

func TestFillAdopted(t *testing.T) {
	useTestFiller(t)
	for _, tc := range []struct {
		name   string
		tamper func(table []byte) []byte
		adopt  string // the adoption's error, if it fails
	}{
		{"adopted", nil, ""},
		// Two mappings of a size swap addresses: the filler fills each
		// by the table, and the process must refuse it (each one's bytes
		// would land where the other's were).
		{"not the process's table", func(b []byte) []byte {
			lines := strings.Split(string(b), "\n")
			seen := map[string]int{}
			for i, l := range lines {
				f := strings.Fields(l)
				if len(f) != 5 || f[0] != "m" {
					continue
				}
				if j, ok := seen[f[3]]; ok {
					g := strings.Fields(lines[j])
					g[2], f[2] = f[2], g[2]
					lines[i], lines[j] = strings.Join(f, " "), strings.Join(g, " ")
					return []byte(strings.Join(lines, "\n"))
				}
				seen[f[3]] = i
			}
			t.Fatalf("no two mappings of a size in %s", b)
			return nil
		}, "not this process's"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			tg, st, p, procs := suspendedForFill(t)
			if tc.tamper != nil {
				st.Tables[p.Handles] = tc.tamper(st.Tables[p.Handles])
			}
			fill := StartFill(ctx, storeSource{st: st}, nil, procs, nil, nil)
			defer fill.Close()
			filled := fill.Take(ctx, p.PID)
			if filled == nil {
				t.Fatalf("nothing filled: %+v", fill.Phases())
			}
			res, err := vram.FastResume(ctx, tg.SockDir, tg.PID, p.Files, st.Get, nil, filled)
			if err != nil {
				t.Fatal(err)
			}
			if tc.adopt == "" && (res.AdoptErr != nil || res.Adopted == 0 || res.Adopted != len(filled.Handles)) {
				t.Fatalf("adopted %d of %d: %v", res.Adopted, len(filled.Handles), res.AdoptErr)
			}
			if tc.adopt != "" && (res.AdoptErr == nil || !strings.Contains(res.AdoptErr.Error(), tc.adopt) || res.Adopted != 0) {
				t.Fatalf("adopted %d, error %v; want %q", res.Adopted, res.AdoptErr, tc.adopt)
			}
			tg.MustBeIntact(t)
		})
	}
}

// A fill that would leave the driver's restore of the process too little
// device memory (what it used beyond its handles, and a margin) does not
// run: the copy in does the work.
func TestFillLeavesRoom(t *testing.T) {
	useTestFiller(t)
	ctx := context.Background()
	tg, st, p, procs := suspendedForFill(t)
	// The fake driver's device has 1 TiB.
	gpus := []manifest.GPU{{UUID: "GPU-66616b65-2d67-7075-0000-000000000000", PID: p.PID, Bytes: 1 << 40}}
	fill := StartFill(ctx, storeSource{st: st}, nil, procs, gpus, nil)
	defer fill.Close()
	if f := fill.Take(ctx, p.PID); f != nil {
		t.Fatalf("filled %d handles with no room left for the driver's restore", len(f.Handles))
	}
	if ps := fill.Phases(); len(ps) != 2 || !strings.Contains(ps[1].Name, "for the driver's restore") {
		t.Fatalf("phases %+v, want the fill's refusal", ps)
	}
	if _, err := vram.FastResume(ctx, tg.SockDir, tg.PID, p.Files, st.Get, nil, nil); err != nil {
		t.Fatal(err)
	}
	tg.MustBeIntact(t)
}

// FuzzFillTable: a filler takes any table (a checkpoint's bytes) without
// crashing; what it creates from one is only ever adopted by a process
// whose own table it is (TestFillAdopted).
func FuzzFillTable(f *testing.F) {
	useTestFiller(f)
	ctx := context.Background()
	tg := vramtest.Start(f)
	st, s := fastSuspended(f, tg, false)
	f.Add(st.Tables[s.fast.Procs()[0].Handles])
	f.Add([]byte("GPUCRHT1\nend\n"))
	f.Add([]byte("GPUCRHT1\nh 0 4096 0\n"))
	f.Add([]byte("GPUCRHT1\nd 0 66616b652d6770750000000000000000\nh 0 4194304 0\nm 0 0x1000 8192 4190000\nm 7 0x1000 4096 0\nend\n"))
	f.Fuzz(func(t *testing.T, table []byte) {
		fl := &filling{}
		if err := fl.start(tg.PID); err != nil {
			t.Fatal(err)
		}
		mf, err := os.CreateTemp(t.TempDir(), "table")
		if err == nil {
			_, err = mf.Write(table)
		}
		if err != nil {
			t.Fatal(err)
		}
		defer mf.Close()
		_, _, ferr := fl.conn.FillTable(ctx, mf, 0, 0)
		fl.conn.Close()
		if err := fl.cmd.Wait(); err != nil {
			t.Fatalf("the filler ended with %v on %q (the table's answer: %v); it said %s", err, table, ferr, fl.stderr.String())
		}
	})
}
