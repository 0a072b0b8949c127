package swrk

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"google.golang.org/protobuf/proto"

	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/hostroom/cgrouptest"
)

// v2Cgroup makes a cgroup v2 holding a sleeping process (cgrouptest.V2).
func v2Cgroup(t *testing.T) string {
	t.Helper()
	cg := cgrouptest.V2(t)
	sleep := exec.Command("sleep", "600")
	if err := sleep.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = sleep.Process.Kill()
		_ = sleep.Wait()
	})
	cg.Move(sleep.Process.Pid)
	return cg.Dir
}

// frozenNow says whether cgroup dir is frozen, waiting up to a second
// for it to reach want.
func frozenNow(t *testing.T, dir string, want bool) bool {
	t.Helper()
	var got bool
	for range 100 {
		b, err := os.ReadFile(filepath.Join(dir, "cgroup.events"))
		if err != nil {
			t.Fatal(err)
		}
		if got = frozen(b); got == want {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	return got
}

// TestFreezeAhead: a thawed v2 cgroup is frozen on return and thawed by
// what it returns; one frozen already, a directory that is no v2 cgroup
// and a cgroup that does not freeze in time are left as they were.
func TestFreezeAhead(t *testing.T) {
	ctx := context.Background()
	t.Run("thawed", func(t *testing.T) {
		dir := v2Cgroup(t)
		thaw := freezeAhead(ctx, dir)
		b, _ := os.ReadFile(filepath.Join(dir, "cgroup.events"))
		if !frozen(b) {
			t.Fatalf("not frozen on return: %q", b)
		}
		if err := thaw(); err != nil {
			t.Fatal(err)
		}
		if frozenNow(t, dir, false) {
			t.Fatal("still frozen after the thaw")
		}
	})
	t.Run("frozen already", func(t *testing.T) {
		dir := v2Cgroup(t)
		if err := os.WriteFile(filepath.Join(dir, "cgroup.freeze"), []byte("1"), 0); err != nil {
			t.Fatal(err)
		}
		if !frozenNow(t, dir, true) {
			t.Fatal("did not freeze")
		}
		if err := freezeAhead(ctx, dir)(); err != nil {
			t.Fatal(err)
		}
		if !frozenNow(t, dir, true) {
			t.Fatal("a cgroup frozen by someone else was thawed")
		}
	})
	t.Run("no v2 cgroup", func(t *testing.T) {
		for _, dir := range []string{"", t.TempDir(), "/nonexistent"} {
			if err := freezeAhead(ctx, dir)(); err != nil {
				t.Errorf("%q: %v", dir, err)
			}
		}
	})
	t.Run("not frozen in time", func(t *testing.T) {
		// Files that no kernel updates: the freeze never completes.
		dir := t.TempDir()
		for name, body := range map[string]string{"cgroup.freeze": "0\n", "cgroup.events": "populated 1\nfrozen 0\n"} {
			if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		defer func(d time.Duration) { freezeWait = d }(freezeWait)
		freezeWait = 50 * time.Millisecond
		start := time.Now()
		thaw := freezeAhead(ctx, dir)
		if d := time.Since(start); d < freezeWait {
			t.Errorf("returned after %v, before freezeWait", d)
		}
		if b, _ := os.ReadFile(filepath.Join(dir, "cgroup.freeze")); string(b) != "0" {
			t.Fatalf("cgroup.freeze %q after a freeze not done in time, want it undone", b)
		}
		_ = os.WriteFile(filepath.Join(dir, "cgroup.freeze"), []byte("untouched"), 0o644)
		if err := thaw(); err != nil {
			t.Fatal(err)
		}
		if b, _ := os.ReadFile(filepath.Join(dir, "cgroup.freeze")); string(b) != "untouched" {
			t.Fatalf("the thaw of a freeze undone wrote %q", b)
		}
	})
}

// TestServeDumpFreezesAhead: a dump's v2 cgroup is frozen when CRIU
// starts, and thawed before the runtime hears the answer, whether the
// dump succeeded or failed (CRIU leaves a cgroup it found frozen frozen).
func TestServeDumpFreezesAhead(t *testing.T) {
	for _, tc := range []struct {
		name string
		exit string
	}{{"dumped", ""}, {"criu failed", "1"}} {
		t.Run(tc.name, func(t *testing.T) {
			cg := v2Cgroup(t)
			dir, fd := streamerDir(t, criusock.CaptureSocket)
			t.Setenv("FAKE_CGROUP", cg)
			t.Setenv("FAKE_EXIT", tc.exit)
			o := runcDump()
			o.ImagesDirFd, o.WorkDirFd, o.ConfigFile, o.NotifyScripts = proto.Int32(fd), nil, nil, proto.Bool(false)
			o.FreezeCgroup = proto.String(cg)
			r := startSwrk(t, &rpc.CriuReq{Type: rpc.CriuReqType_DUMP.Enum(), Opts: o})
			resp := r.read()
			if resp.GetSuccess() != (tc.exit == "") {
				t.Fatalf("answer %v", resp)
			}
			if b, _ := os.ReadFile(cg + "/cgroup.events"); frozen(b) {
				t.Errorf("cgroup frozen when the runtime heard the answer: %q", b)
			}
			<-r.served
			if b, _ := os.ReadFile(filepath.Join(dir, "events")); !frozen(b) {
				t.Errorf("CRIU started with the cgroup not frozen: %q", b)
			}
		})
	}
}
