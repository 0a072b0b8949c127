package criusock

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	pstreeimg "github.com/checkpoint-restore/go-criu/v7/crit/images/pstree"
	"google.golang.org/protobuf/proto"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/proc"
)

// pstreeImage is a pstree.img of the given processes: each a PID, then
// its threads.
func pstreeImage(t testing.TB, procs ...[]uint32) []byte {
	img := binary.LittleEndian.AppendUint32(nil, imgCommonMagic)
	img = binary.LittleEndian.AppendUint32(img, pstreeMagic)
	for _, p := range procs {
		raw, err := proto.Marshal(&pstreeimg.PstreeEntry{Pid: &p[0], Ppid: new(uint32), Pgid: &p[0], Sid: &p[0], Threads: p})
		if err != nil {
			t.Fatal(err)
		}
		img = binary.LittleEndian.AppendUint32(img, uint32(len(raw)))
		img = append(img, raw...)
	}
	return img
}

func TestPstreePIDs(t *testing.T) {
	pids, own, err := pstreePIDs(pstreeImage(t, []uint32{100, 101, 102}, []uint32{200}))
	if err != nil || own || !slices.Equal(pids, []int{100, 101, 102, 200}) {
		t.Errorf("got %v, %v, %v", pids, own, err)
	}
	if _, own, err := pstreePIDs(pstreeImage(t, []uint32{1}, []uint32{7})); err != nil || !own {
		t.Errorf("a tree whose root is PID 1: own namespace %v, %v", own, err)
	}
	img := pstreeImage(t, []uint32{100})
	for _, bad := range [][]byte{nil, img[:len(img)-1], append(slices.Clone(img[:8]), 2, 0, 0, 0, 0xff, 0xff)} {
		if _, _, err := pstreePIDs(bad); !errors.Is(err, errdefs.ErrCorrupt) {
			t.Errorf("%x: %v, want ErrCorrupt", bad, err)
		}
	}
}

// FuzzPstreePIDs: any pstree.img is read or refused, never a panic.
func FuzzPstreePIDs(f *testing.F) {
	f.Add(pstreeImage(f, []uint32{100, 101}, []uint32{200}))
	f.Fuzz(func(t *testing.T, b []byte) {
		pids, _, err := pstreePIDs(b)
		if err == nil && len(pids) > len(b) {
			t.Fatalf("%d PIDs from %d bytes", len(pids), len(b))
		}
	})
}

// TestWaitFreePIDs: the first read of pstree.img waits while a PID it
// restores is taken, and says by whom; it goes on once the PID is free,
// and fails naming the PID and its holder when it stays taken. A tree of a
// PID namespace of its own is not waited for.
func TestWaitFreePIDs(t *testing.T) {
	ctx := context.Background()
	holder := func() *exec.Cmd {
		cmd := exec.Command("sleep", "1000")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd
	}
	serve := func(img []byte, timeout time.Duration, log func(string)) ([]byte, error) {
		src := waitFreePIDs(&fakeSource{files: map[string][]byte{pstreeFile: img}}, timeout, log)
		var out bytes.Buffer
		_, err := src.Copy(ctx, pstreeFile, &out)
		return out.Bytes(), err
	}

	t.Run("freed while waiting", func(t *testing.T) {
		cmd := holder()
		pid := uint32(cmd.Process.Pid)
		img := pstreeImage(t, []uint32{pid})
		var said string
		got, err := serve(img, time.Hour, func(s string) {
			said = s
			cmd.Process.Kill() // its parent reaps it: the PID is free
			cmd.Wait()
		})
		if err != nil || !bytes.Equal(got, img) {
			t.Fatalf("%v", err)
		}
		if !strings.Contains(said, fmt.Sprintf("PID %d", pid)) || !strings.Contains(said, `"sleep 1000"`) {
			t.Errorf("said %q", said)
		}
	})
	t.Run("stays taken", func(t *testing.T) {
		cmd := holder()
		_, err := serve(pstreeImage(t, []uint32{uint32(cmd.Process.Pid)}), time.Millisecond, nil)
		want := fmt.Sprintf(`PID %d by process %d "sleep 1000" (`, cmd.Process.Pid, cmd.Process.Pid)
		if !errors.Is(err, ErrPIDTaken) || !strings.Contains(err.Error(), want) {
			t.Fatalf("%v, want %q", err, want)
		}
	})
	t.Run("a zombie", func(t *testing.T) {
		cmd := holder()
		cmd.Process.Kill() // not reaped
		for proc.State(cmd.Process.Pid) != 'Z' {
			time.Sleep(time.Millisecond)
		}
		_, err := serve(pstreeImage(t, []uint32{uint32(cmd.Process.Pid)}), time.Millisecond, nil)
		if !errors.Is(err, ErrPIDTaken) || !strings.Contains(err.Error(), "a zombie its parent") {
			t.Fatalf("%v", err)
		}
	})
	t.Run("own PID namespace", func(t *testing.T) {
		if _, err := serve(pstreeImage(t, []uint32{1}), time.Millisecond, nil); err != nil {
			t.Fatal(err)
		}
	})
}
