package e2e

// Containers through their runtime (issue 40): runc and Podman run
// gpucr-stream as their CRIU (swrk), and the restored container is the
// runtime's: it lists it running, in the container's cgroups, and a later
// checkpoint of it works.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// checkpointedOut checks that the runtime no longer runs the container
// (it was checkpointed without --leave-running) and its init is gone.
func checkpointedOut(ctx context.Context, t *testing.T, tg *Target, pid func() (int, error)) {
	t.Helper()
	if p, err := pid(); err == nil {
		t.Fatalf("the container still runs (init %d) after its checkpoint", p)
	}
	if err := WaitPIDGone(ctx, tg.PID()); err != nil {
		t.Fatal(err)
	}
}

// TestRuncContainer: a runc container with a bind mount and a counter
// (the target), checkpointed to a directory (deduplicated) and to MinIO
// (encrypted), each time restored as the runc container it was: runc
// lists it running, in the container's cgroups, and it counts on; each
// checkpoint after the first is of a restored container.
func TestRuncContainer(t *testing.T) {
	runc := Runtime(t, "runc")
	s3 := startS3(t)
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	root, data := mkdir(t, filepath.Join(dir, "runc")), mkdir(t, filepath.Join(dir, "data"))
	bundle := runcBundle(t, runc, mkdir(t, filepath.Join(dir, "bundle")), data, targetArgs(64, "model"))
	const id = "gcs-e2e"
	tg := startRunc(ctx, t, runc, root, bundle, id, data)
	pid := func() (int, error) { return runcPID(runc, root, id) }
	before, err := tg.Prove(ctx)
	if err == nil {
		err = before.Verify()
	}
	if err != nil {
		t.Fatal(err)
	}
	cgroups := map[string]string{}
	for _, c := range []string{"memory", "pids", "freezer"} {
		cgroups[c] = cgroupOf(t, tg.PID(), c)
	}
	bin := BuildBinary(t, "./cmd/gpucr-stream")
	key := filepath.Join(dir, "key")
	if out, err := exec.Command(bin, "keygen").Output(); err != nil || os.WriteFile(key, out, 0o600) != nil {
		t.Fatalf("keygen: %v", err)
	}
	for _, round := range []struct {
		name, to     string
		flags, rflag []string // checkpoint's, restore's
	}{
		{"directory, dedup", filepath.Join(dir, "loc", "one"), []string{"--dedup"}, nil},
		{"minio, encrypted", s3.url("containers/two"), []string{"--key-file", key}, []string{"--key-file", key}},
		{"directory again, dedup", filepath.Join(dir, "loc", "three"), []string{"--dedup"}, nil},
	} {
		t.Logf("round: %s", round.name)
		args := append([]string{"checkpoint", "--container", id, "--runtime-root", root, "--to", round.to}, round.flags...)
		gcsRun(ctx, t, args...).ok(t, "checkpoint "+round.name)
		checkpointedOut(ctx, t, tg, pid)
		args = append([]string{"restore", "--container", id, "--runtime-root", root, "--from", round.to}, round.rflag...)
		gcsRun(ctx, t, args...).ok(t, "restore "+round.name)
		tg.follow(t, pid)
		if list := runtimeCmd(ctx, t, runc, "--root", root, "list"); !strings.Contains(list, id) || !strings.Contains(list, "running") {
			t.Fatalf("runc list after the restore:\n%s", list)
		}
		for c, want := range cgroups {
			if got := cgroupOf(t, tg.PID(), c); got != want {
				t.Errorf("restored init %d in %s cgroup %q, the container's is %q", tg.PID(), c, got, want)
			}
		}
		before = proveContainer(ctx, t, tg, before)
	}
	// What runc needs back rode in the checkpoint, carried.
	ins := gcsRun(ctx, t, "inspect", "--json", filepath.Join(dir, "loc", "one")).ok(t, "inspect")
	for _, name := range []string{"descriptors.json", "container.json"} {
		if !strings.Contains(ins.stdout, `"name": "`+name+`"`) {
			t.Errorf("inspect lists no %s:\n%s", name, ins.stdout)
		}
	}
	if !strings.Contains(ins.stdout, `"carried": true`) {
		t.Errorf("inspect marks no file carried:\n%s", ins.stdout)
	}
	if v := criuVersionText(t); !strings.Contains(ins.stdout, `"criu_version": "`+v+`"`) {
		t.Errorf("inspect does not give criu's version %s:\n%s", v, ins.stdout)
	}
}

// TestRuncMigrate: `migrate --container` moves a runc container over
// loopback from one runc state dir to another (two runc roots, as two
// hosts have), where `receive --restore --container` restores it as that
// runc's container, counting on.
func TestRuncMigrate(t *testing.T) {
	runc := Runtime(t, "runc")
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	rootA, rootB := mkdir(t, filepath.Join(dir, "runc-a")), mkdir(t, filepath.Join(dir, "runc-b"))
	data := mkdir(t, filepath.Join(dir, "data"))
	bundle := runcBundle(t, runc, mkdir(t, filepath.Join(dir, "bundle")), data, targetArgs(64, "model"))
	const id = "gcs-e2e-mig"
	tg := startRunc(ctx, t, runc, rootA, bundle, id, data)
	t.Cleanup(func() { exec.Command(runc, "--root", rootB, "delete", "--force", id).Run() })
	before, err := tg.Prove(ctx)
	if err != nil {
		t.Fatal(err)
	}
	tok := writeToken(t, BuildBinary(t, "./cmd/gpucr-stream"), filepath.Join(dir, "token"))
	// Both --net-timeouts leave room for a loaded host, where the sender
	// may wait seconds for its init to reap the checkpointed container
	// before it says "restore".
	r := startReceiver(t, exec.CommandContext(ctx, BuildBinary(t, "./cmd/gpucr-stream"), "receive", "--listen", "127.0.0.1:0",
		"--token-file", tok, "--net-timeout", "30s", "--restore", "--no-progress",
		"--container", id, "--runtime-root", rootB, "--work-dir", filepath.Join(dir, "recv")), 30*time.Second)
	// The container's init is an orphan of `runc run --detach`: where an
	// earlier test made this process a subreaper, it is ours to reap, and
	// migrate waits for that before the receiver restores.
	reaped := make(chan error, 1)
	go func() { reaped <- WaitPIDGone(ctx, tg.PID()) }()
	gcsRun(ctx, t, "migrate", "--container", id, "--runtime-root", rootA, "--to", "tcp://"+r.addr, "--token-file", tok,
		"--net-timeout", "30s", "--work-dir", filepath.Join(dir, "send")).ok(t, "migrate")
	if err := r.wait(ctx); err != nil {
		t.Fatal(err)
	}
	if p, err := runcPID(runc, rootA, id); err == nil {
		t.Fatalf("the container still runs in the sending runc root (init %d)", p)
	}
	if err := <-reaped; err != nil {
		t.Fatal(err)
	}
	tg.follow(t, func() (int, error) { return runcPID(runc, rootB, id) })
	proveContainer(ctx, t, tg, before)
}

// TestPodmanRoundTrip: a Podman container checkpointed through Podman and
// restored as the same container (Podman lists it running, counting on),
// then checkpointed again, removed, and restored as a new container from
// podman's archive layout, with the change to its root file system.
func TestPodmanRoundTrip(t *testing.T) {
	podman := Runtime(t, "podman")
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	data := mkdir(t, filepath.Join(dir, "data"))
	image := podmanImage(ctx, t, podman, mkdir(t, filepath.Join(dir, "image")))
	name, renamed := fmt.Sprintf("gcs-e2e-%d", os.Getpid()), fmt.Sprintf("gcs-e2e-new-%d", os.Getpid())
	t.Cleanup(func() { exec.Command(podman, "rm", "--force", renamed).Run() })
	tg := podmanRun(ctx, t, podman, image, name, data, 64)
	pid := func() (int, error) { return podmanPID(podman, name) }
	before, err := tg.Prove(ctx)
	if err != nil {
		t.Fatal(err)
	}
	marker := filepath.Join(dir, "marker")
	if err := os.WriteFile(marker, []byte("in the root file system\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	runtimeCmd(ctx, t, podman, "cp", marker, name+":/marker")
	one, two := filepath.Join(dir, "loc", "one"), filepath.Join(dir, "loc", "two")
	gcsRun(ctx, t, "checkpoint", "--container", name, "--runtime", "podman", "--to", one).ok(t, "checkpoint")
	checkpointedOut(ctx, t, tg, pid)
	gcsRun(ctx, t, "restore", "--container", name, "--runtime", "podman", "--from", one).ok(t, "restore as the same container")
	tg.follow(t, pid)
	if ps := runtimeCmd(ctx, t, podman, "ps", "--format", "{{.Names}} {{.Status}}"); !strings.Contains(ps, name+" Up") {
		t.Fatalf("podman ps after the restore:\n%s", ps)
	}
	before = proveContainer(ctx, t, tg, before)

	gcsRun(ctx, t, "checkpoint", "--container", name, "--runtime", "podman", "--to", two).ok(t, "checkpoint of the restored container")
	checkpointedOut(ctx, t, tg, pid)
	runtimeCmd(ctx, t, podman, "rm", name)
	gcsRun(ctx, t, "restore", "--container", renamed, "--runtime", "podman", "--from", two).ok(t, "restore as a new container")
	tg.follow(t, func() (int, error) { return podmanPID(podman, renamed) })
	proveContainer(ctx, t, tg, before)
	if got := runtimeCmd(ctx, t, podman, "cp", renamed+":/marker", "-"); !strings.Contains(got, "in the root file system") {
		t.Errorf("the root file system change did not come along: %q", got)
	}
}

// TestCheckpointctlArchive: Podman's own checkpoint archive (podman
// container checkpoint --export, CRIU run by Podman as usual) copied into
// a gpucr-stream location restores as a Podman container through
// gpucr-stream; a gpucr-stream checkpoint copied out as an archive in the
// same layout restores with Podman alone (podman container restore
// --import). Both count on.
func TestCheckpointctlArchive(t *testing.T) {
	podman := Runtime(t, "podman")
	// Podman's runc runs the criu on PATH when gpucr-stream is not its criu.
	t.Setenv("PATH", filepath.Dir(CRIU(t))+string(os.PathListSeparator)+os.Getenv("PATH"))
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	data := mkdir(t, filepath.Join(dir, "data"))
	image := podmanImage(ctx, t, podman, mkdir(t, filepath.Join(dir, "image")))
	name, other := fmt.Sprintf("gcs-e2e-tar-%d", os.Getpid()), fmt.Sprintf("gcs-e2e-tar-b-%d", os.Getpid())
	t.Cleanup(func() { exec.Command(podman, "rm", "--force", other).Run() })
	tg := podmanRun(ctx, t, podman, image, name, data, 32)
	before, err := tg.Prove(ctx)
	if err != nil {
		t.Fatal(err)
	}
	exported := filepath.Join(dir, "podman.tar.zst")
	runtimeCmd(ctx, t, podman, "container", "checkpoint", "--export", exported, name)
	checkpointedOut(ctx, t, tg, func() (int, error) { return podmanPID(podman, name) })
	imported := filepath.Join(dir, "loc", "imported")
	gcsRun(ctx, t, "cp", exported, imported).ok(t, "cp podman's archive into a location")
	runtimeCmd(ctx, t, podman, "rm", name)
	gcsRun(ctx, t, "restore", "--container", name, "--runtime", "podman", "--from", imported).ok(t, "restore the imported archive")
	tg.follow(t, func() (int, error) { return podmanPID(podman, name) })
	before = proveContainer(ctx, t, tg, before)

	ours := filepath.Join(dir, "loc", "ours")
	gcsRun(ctx, t, "checkpoint", "--container", name, "--runtime", "podman", "--to", ours).ok(t, "checkpoint")
	archive := filepath.Join(dir, "ours.tar.gz")
	gcsRun(ctx, t, "cp", ours, archive).ok(t, "cp a checkpoint out as an archive")
	listing := runtimeCmd(ctx, t, "tar", "tzf", archive)
	for _, want := range []string{"checkpoint/inventory.img\n", "checkpoint/descriptors.json\n", "\nconfig.dump\n", "\nspec.dump\n"} {
		if !strings.Contains("\n"+listing, want) {
			t.Errorf("the archive lacks %q:\n%s", strings.TrimSpace(want), listing)
		}
	}
	runtimeCmd(ctx, t, podman, "rm", name)
	runtimeCmd(ctx, t, podman, "container", "restore", "--import", archive, "--name", other)
	tg.follow(t, func() (int, error) { return podmanPID(podman, other) })
	proveContainer(ctx, t, tg, before)
}

// TestRuncByHand: runc in stream mode with the drop-in commands, as the
// docs/CONTAINERS.md shows it: a capture listening in the images dir makes `runc
// --criu gpucr-stream checkpoint` stream into it, carrying runc's
// descriptors.json; a serve writes that back into its images dir before it
// listens, and `runc --criu gpucr-stream restore` restores from it.
func TestRuncByHand(t *testing.T) {
	runc := Runtime(t, "runc")
	bin := BuildBinary(t, "./cmd/gpucr-stream")
	// runc's version checks go to the real criu, which swrk finds on PATH.
	t.Setenv("PATH", filepath.Dir(CRIU(t))+string(os.PathListSeparator)+os.Getenv("PATH"))
	ctx := testCtx(t)
	dir := ShortTempDir(t)
	tg, root, id, pid := RuncContainer(ctx, t, dir, 32)
	before, err := tg.Prove(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ck, stream := mkdir(t, filepath.Join(dir, "ck")), filepath.Join(dir, "stream")
	capture := startGCS(ctx, t, gcsOpts{}, "--images-dir", ck, "capture", "--to", stream)
	if !capture.waitLine(ctx, "socket-init") {
		t.Fatalf("capture: %v", capture.wait(ctx))
	}
	runtimeCmd(ctx, t, runc, "--root", root, "--criu", bin, "checkpoint", "--image-path", ck, id)
	if err := capture.wait(ctx); err != nil {
		t.Fatal(err)
	}
	checkpointedOut(ctx, t, tg, pid)
	rs := mkdir(t, filepath.Join(dir, "rs"))
	serve := startGCS(ctx, t, gcsOpts{}, "--images-dir", rs, "serve", "--from", stream)
	if !serve.waitLine(ctx, "socket-init") {
		t.Fatalf("serve: %v", serve.wait(ctx))
	}
	if b, err := os.ReadFile(filepath.Join(rs, "descriptors.json")); err != nil || !strings.Contains(string(b), "/dev/null") {
		t.Fatalf("descriptors.json not written back before socket-init: %q, %v", b, err)
	}
	log := filepath.Join(dir, "runc.log")
	cmd := exec.CommandContext(ctx, runc, "--root", root, "--log", log, "--criu", bin, "restore", "--detach", "--image-path", rs,
		"--bundle", filepath.Join(dir, "bundle"), id)
	if err := cmd.Run(); err != nil {
		b, _ := os.ReadFile(log)
		t.Fatalf("runc restore: %v: %s", err, b)
	}
	if err := serve.wait(ctx); err != nil {
		t.Fatal(err)
	}
	tg.follow(t, pid)
	proveContainer(ctx, t, tg, before)
}
