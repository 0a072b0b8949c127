package vram

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/preloadctl"
	"github.com/gpucr/gpucr-stream/vram/vramtest"
)

// TestHashDevice runs devhash on the fake driver, whose "kernel" is
// devhash.h on the host: what is tested here is the library's side (which
// memory, the blocks, the comparison with the last call, the host check,
// park and unpark) and the copy and host hashing beside it; the PTX kernel
// itself is checked on a GPU (`gpu hash --host-check`, e2e/gpu/run.sh).
func TestHashDevice(t *testing.T) {
	tg := vramtest.Start(t)
	ctx := context.Background()
	dir := vramtest.OpenTempDir(t)
	want := tg.Report(t).Bytes
	r, err := HashDevice(ctx, tg.SockDir, tg.PID, HashOptions{Check: true, Scratch: dir, Files: 3})
	if err != nil {
		t.Fatal(err)
	}
	d := r.Device
	if d.Bytes != want || d.Blocks < want/DefaultHashBlock || !d.Checked || d.MismatchedBlocks != 0 || d.Compared || len(d.Digest) != 32 {
		t.Fatalf("first hash: %+v (the library holds %d bytes)", d, want)
	}
	if w := tg.Written(t, false); r.CopyBytes != w || r.HostHashed < w || r.HostCores < 1 {
		t.Fatalf("copy and host hash: %+v", r)
	}
	if rep := tg.Report(t); rep.Parked {
		t.Fatal("the program is parked after gpu hash")
	}
	tg.MustBeIntact(t)

	// One region rewritten: its blocks, and the counter's, changed.
	pitch := tg.Rewrite(t, "pitch")
	r2, err := HashDevice(ctx, tg.SockDir, tg.PID, HashOptions{})
	if err != nil {
		t.Fatal(err)
	}
	d2 := r2.Device
	if !d2.Compared || d2.ChangedBytes < int64(pitch.Size) || d2.ChangedBytes > int64(pitch.Size)+3*DefaultHashBlock ||
		d2.ChangedBytes+d2.UnchangedBytes != want || d2.Digest == d.Digest || r2.CopyBytes != 0 {
		t.Fatalf("after a rewrite of %d bytes: %+v", pitch.Size, d2)
	}
	tg.MustBeIntact(t)

	// Another block size is not compared with the last call's.
	r3, err := HashDevice(ctx, tg.SockDir, tg.PID, HashOptions{Block: 1 << 20})
	if err != nil || r3.Device.Compared || r3.Device.Blocks >= d.Blocks {
		t.Fatalf("1 MiB blocks: %+v, %v", r3.Device, err)
	}

	// devhash is refused unless parked.
	p, err := preloadctl.Dial(ctx, tg.SockDir, tg.PID)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if _, err := p.DevHash(ctx, DefaultHashBlock, 0, false); err == nil || !strings.Contains(err.Error(), "not parked") {
		t.Fatalf("devhash while running: %v", err)
	}
	if _, err := p.DevHash(ctx, 100, 0, false); err == nil || !strings.Contains(err.Error(), "want BLOCK") {
		t.Fatalf("devhash of blocks of 100 bytes: %v", err)
	}
}

// TestHashDeviceWrongKernel: a kernel whose hashes are wrong is caught by
// the host check, the command fails, and the program runs on.
func TestHashDeviceWrongKernel(t *testing.T) {
	tg := vramtest.Start(t, "GPUCR_FAKE_DEVHASH_WRONG=1")
	_, err := HashDevice(context.Background(), tg.SockDir, tg.PID, HashOptions{Check: true})
	if !errors.Is(err, errdefs.ErrCorrupt) || !strings.Contains(err.Error(), "differ from the host's") {
		t.Fatalf("wrong kernel: %v", err)
	}
	if rep := tg.Report(t); rep.Parked {
		t.Fatal("the program is parked after a failed gpu hash")
	}
	tg.MustBeIntact(t)
}
