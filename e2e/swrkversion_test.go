package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/swrk"
)

// askVersion runs `program swrk 3` with env, as runc runs its criu for
// the version (go-criu: one VERSION request, then the socket closed), and
// returns the answer; the program must exit 0.
func askVersion(t *testing.T, program string, env []string) *rpc.CriuResp {
	t.Helper()
	return askSwrk(t, program, env, &rpc.CriuReq{Type: rpc.CriuReqType_VERSION.Enum()})
}

// askSwrk runs `program swrk 3` with env, sends it req as a runtime
// does, and returns its answer; the program must exit 0.
func askSwrk(t *testing.T, program string, env []string, req *rpc.CriuReq) *rpc.CriuResp {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "runtime"), os.NewFile(uintptr(fds[1]), "criu")
	defer ours.Close()
	cmd := exec.Command(program, "swrk", "3")
	cmd.ExtraFiles, cmd.Env = []*os.File{theirs}, env
	var stderr strings.Builder
	cmd.Stderr = &stderr
	err = cmd.Start()
	theirs.Close()
	if err != nil {
		t.Fatal(err)
	}
	b, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ours.Write(b); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<16)
	n, err := ours.Read(buf)
	if err != nil {
		t.Fatalf("%s swrk: no answer to %v: %v (%s)", program, req.GetType(), err, stderr.String())
	}
	resp := &rpc.CriuResp{}
	if err := proto.Unmarshal(buf[:n], resp); err != nil {
		t.Fatal(err)
	}
	ours.Close()
	if err := cmd.Wait(); err != nil {
		t.Fatalf("%s swrk after the %v answer: %v (%s)", program, req.GetType(), err, stderr.String())
	}
	return resp
}

// TestContainerSwrkVersion: runc's version check through gpucr-stream's
// swrk (and gpucr-stream-swrk's) gets the real criu's answer, word for word, both where
// checkpoint --container told swrk the version (answered without
// starting criu) and where it did not (criu answers); the version a
// checkpoint records is the one `criu --version` prints.
func TestContainerSwrkVersion(t *testing.T) {
	real := CRIU(t)
	bin, swrkBin := BuildBinary(t, "./cmd/gpucr-stream"), BuildBinary(t, "./cmd/gpucr-stream-swrk")
	ctx := testCtx(t)
	want := askVersion(t, real, os.Environ())
	if !want.GetSuccess() || want.GetVersion().GetMajorNumber() < 4 {
		t.Fatalf("criu's own answer: %v", want)
	}
	// A criu on PATH that leaves a mark when it runs.
	dir := t.TempDir()
	criu, ran := filepath.Join(dir, "criu"), filepath.Join(dir, "ran")
	script := "#!/bin/sh\necho \"$@\" >> " + ran + "\nexec " + real + " \"$@\"\n"
	if err := os.WriteFile(criu, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	q := criusock.StartVersionQuery(ctx, criu)
	v, err := q.Wait()
	if err != nil || !proto.Equal(v, want.GetVersion()) {
		t.Fatalf("criusock's query: %v, %v; criu says %v", v, err, want.GetVersion())
	}
	if got, want := criusock.VersionString(v), criuVersionText(t); got != want {
		t.Fatalf("version %q, criu --version says %q", got, want)
	}
	path := "PATH=" + dir + string(os.PathListSeparator) + os.Getenv("PATH")
	told := swrk.VersionEnv(q)
	if told == "" {
		t.Fatal("no version to tell swrk")
	}
	for _, c := range []struct {
		name   string
		env    []string
		starts bool // criu runs
	}{
		{"told", []string{path, told}, false},
		{"not told", []string{path}, true},
		{"told of another criu", []string{path, strings.Replace(told, criu, real, 1)}, true},
	} {
		for _, prog := range []string{bin, swrkBin} {
			t.Run(c.name+"/"+filepath.Base(prog), func(t *testing.T) {
				os.Remove(ran)
				got := askVersion(t, prog, append(os.Environ(), c.env...))
				if !proto.Equal(got, want) {
					t.Errorf("swrk answered %v, criu %v", got, want)
				}
				if _, err := os.Stat(ran); (err == nil) != c.starts {
					t.Errorf("criu started: %v, want %v", err == nil, c.starts)
				}
			})
		}
	}
}

// criuVersionText is the version `criu --version` prints ("4.2.1").
func criuVersionText(t *testing.T) string {
	t.Helper()
	out, err := exec.Command(CRIU(t), "--version").Output()
	for _, l := range strings.Split(string(out), "\n") {
		if v, ok := strings.CutPrefix(l, "Version: "); ok && err == nil {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("criu --version: %v: %s", err, out)
	return ""
}
