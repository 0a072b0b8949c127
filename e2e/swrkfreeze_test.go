package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"google.golang.org/protobuf/proto"

	"github.com/gpucr/gpucr-stream/hostroom/cgrouptest"
	"github.com/gpucr/gpucr-stream/swrk"
)

// TestSwrkFreezesAhead: a runc-shaped dump through gpucr-stream's swrk,
// of a tree in a cgroup v2 named as the freeze cgroup, with real CRIU:
// CRIU finds the cgroup frozen (cgroup.freeze=1 in its log) and does not
// wait for a freeze of its own (no "freezing processes: N attempts done",
// each attempt a 100 ms sleep); with --leave-running the tree is thawed
// and runs on once the answer comes; and the stream restores it.
func TestSwrkFreezesAhead(t *testing.T) {
	CRIU(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	cg := cgrouptest.V2(t)
	tg, before := startedTarget(ctx, t, dir, 64)
	cg.Move(tg.PID())
	cg.Move(tg.ChildPID())

	streamPath := filepath.Join(dir, "ckpt.stream")
	out, err := os.Create(streamPath)
	if err != nil {
		t.Fatal(err)
	}
	a := mkdir(t, filepath.Join(dir, "a"))
	capture := startGCS(ctx, t, gcsOpts{stdout: out}, "--images-dir", a, "capture")
	if !capture.waitLine(ctx, "socket-init") {
		t.Fatalf("capture ended before listening: %v", capture.wait(ctx))
	}
	if err := swrk.WriteSettings(a, swrk.Settings{CRIU: CRIU(t)}); err != nil {
		t.Fatal(err)
	}
	resp := askSwrk(t, BuildBinary(t, "./cmd/gpucr-stream"), os.Environ(), &rpc.CriuReq{Type: rpc.CriuReqType_DUMP.Enum(), Opts: &rpc.CriuOpts{
		ImagesDirFd: proto.Int32(-1), ImagesDir: proto.String(a), Pid: proto.Int32(int32(tg.PID())),
		LeaveRunning: proto.Bool(true), FreezeCgroup: proto.String(cg.Dir), LogLevel: proto.Int32(4), LogFile: proto.String("dump.log"),
	}})
	if !resp.GetSuccess() {
		t.Fatalf("dump through swrk: %v", resp)
	}
	if err := capture.wait(ctx); err != nil {
		t.Fatalf("capture: %v", err)
	}
	out.Close()
	log, err := os.ReadFile(filepath.Join(a, "dump.log"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(log), "cgroup.freeze=1") || strings.Contains(string(log), "freezing processes:") {
		t.Errorf("CRIU did not find the cgroup frozen, or froze it itself; its log's freezer lines:\n%s", grepLines(log, "freez"))
	}
	t.Logf("CRIU's dump, by its log: %s s; %s", lastStamp(log), grepLines(log, "attempts done"))
	if _, err := tg.ProveAdvanced(ctx, before); err != nil {
		t.Fatalf("the tree left running: %v", err)
	}

	tg.Kill()
	restoreStream(ctx, t, dir, streamPath)
	provenRestore(ctx, t, tg, before)
}

// grepLines are b's lines that hold s.
func grepLines(b []byte, s string) string {
	var keep []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, s) {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "\n")
}

// lastStamp is the time of a CRIU log's last stamped line ("(SS.uuuuuu)").
func lastStamp(log []byte) string {
	stamp := ""
	for _, l := range strings.Split(string(log), "\n") {
		if rest, ok := strings.CutPrefix(l, "("); ok {
			if s, _, ok := strings.Cut(rest, ")"); ok {
				stamp = strings.TrimSpace(s)
			}
		}
	}
	return stamp
}
