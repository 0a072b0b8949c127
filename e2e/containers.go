package e2e

// Containers for the container tests: a root file system holding the e2e
// target (a static Go binary, so nothing is pulled from a registry), an
// OCI bundle for runc with a bind mount for the target's work dir, and
// the same root file system imported into Podman as an image. The
// container's target is driven as a Target whose PID is the container's
// init on the host, and whose work dir is the bind mount's host side.

import (
	"archive/tar"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Runtime returns the path of a container runtime (runc, podman) on PATH,
// or skips the test (fails it under CI=true). It builds gpucr-stream-swrk
// beside gpucr-stream, as make build does, so that `--container` points
// the runtime at it (container.Options.Self).
func Runtime(t testing.TB, name string) string {
	t.Helper()
	CRIU(t)
	p, err := exec.LookPath(name)
	if err != nil {
		missing(t, "%s is not installed (apt-get install %s; make deps installs it)", name, name)
	}
	BuildBinary(t, "./cmd/gpucr-stream-swrk")
	return p
}

// containerRootfs makes a root file system in dir holding the target as
// /target, and the mount point of its work dir, /data.
func containerRootfs(t testing.TB, dir string) string {
	t.Helper()
	rootfs := filepath.Join(dir, "rootfs")
	for _, d := range []string{"data", "proc", "sys", "dev", "tmp", "etc"} {
		if err := os.MkdirAll(filepath.Join(rootfs, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(BuildBinary(t, "./e2e/target"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(rootfs, "target"), b, 0o755); err != nil {
		t.Fatal(err)
	}
	return rootfs
}

// targetArgs is the container's command: the target with its work dir in
// the bind mount.
func targetArgs(mb int, mix string) []string {
	return []string{"/target", "--dir", "/data", "--mb", strconv.Itoa(mb), "--mix", mix}
}

// runcBundle writes an OCI bundle (runcSpec) into dir: the
// target as its process, without a terminal, data bind-mounted at /data.
func runcBundle(t testing.TB, runc, dir, data string, args []string) string {
	t.Helper()
	containerRootfs(t, dir)
	runcSpec(t, runc, dir, args, nil, map[string]any{
		"destination": "/data", "type": "bind", "source": data, "options": []string{"rbind", "rw"}})
	return dir
}

// runcSpec writes runc's default spec into the bundle dir, with args as
// its process (no terminal), env (where not nil) as its environment, a
// writable root, and mounts added.
func runcSpec(t testing.TB, runc, dir string, args, env []string, mounts ...any) {
	t.Helper()
	if out, err := exec.Command(runc, "spec", "--bundle", dir).CombinedOutput(); err != nil {
		t.Fatalf("runc spec: %v: %s", err, out)
	}
	path := filepath.Join(dir, "config.json")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var spec map[string]any
	if err := json.Unmarshal(b, &spec); err != nil {
		t.Fatal(err)
	}
	process := spec["process"].(map[string]any)
	process["terminal"] = false
	process["args"] = args
	if env != nil {
		process["env"] = env
	}
	spec["root"].(map[string]any)["readonly"] = false
	spec["mounts"] = append(spec["mounts"].([]any), mounts...)
	if b, err = json.MarshalIndent(spec, "", "\t"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// runtimeCmd runs a runtime command and fails the test if it fails. Its
// output goes through files: a detached container inherits the stdio of
// the runtime that starts it, and would hold a pipe open while it runs.
func runtimeCmd(ctx context.Context, t testing.TB, bin string, args ...string) string {
	t.Helper()
	cmd := exec.CommandContext(ctx, bin, args...)
	var files [2]*os.File
	for i := range files {
		f, err := os.CreateTemp(t.TempDir(), "out-")
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		files[i] = f
	}
	cmd.Stdout, cmd.Stderr = files[0], files[1]
	err := cmd.Run()
	out, _ := os.ReadFile(files[0].Name())
	if err != nil {
		stderr, _ := os.ReadFile(files[1].Name())
		t.Fatalf("%s %s: %v\n%s%s", bin, strings.Join(args, " "), err, out, stderr)
	}
	return string(out)
}

// startRunc runs the bundle as container id under runc's state dir root,
// detached with its stdio on /dev/null (what CRIU dumps without
// --shell-job), and removes it when the test ends.
func startRunc(ctx context.Context, t testing.TB, runc, root, bundle, id, data string) *Target {
	t.Helper()
	// Orphans come to this process, whichever test runs first: the
	// container's init (an orphan of runc run --detach) is ours to reap.
	becomeSubreaper(t)
	// Its stdio on /dev/null (the container's), runc's messages in a log.
	log := filepath.Join(t.TempDir(), "runc.log")
	cmd := exec.CommandContext(ctx, runc, "--root", root, "--log", log, "--log-format", "text", "run", "--detach", "--bundle", bundle, id)
	if err := cmd.Run(); err != nil {
		b, _ := os.ReadFile(log)
		t.Fatalf("runc run %s: %v: %s", id, err, b)
	}
	t.Cleanup(func() {
		exec.Command(runc, "--root", root, "delete", "--force", id).Run()
	})
	return containerTarget(ctx, t, data, func() (int, error) { return runcPID(runc, root, id) })
}

// runcPID is the host PID of container id's init, if it runs.
func runcPID(runc, root, id string) (int, error) {
	out, err := exec.Command(runc, "--root", root, "state", id).Output()
	if err != nil {
		return 0, fmt.Errorf("runc --root %s state %s: %w", root, id, err)
	}
	var st struct {
		PID    int    `json:"pid"`
		Status string `json:"status"`
	}
	if err := json.Unmarshal(out, &st); err != nil {
		return 0, err
	}
	if st.Status != "running" {
		return 0, fmt.Errorf("container %s is %s", id, st.Status)
	}
	return st.PID, nil
}

// containerTarget waits until the target in a container (work dir data,
// init found by pid) is ready and returns it as a Target.
func containerTarget(ctx context.Context, t testing.TB, data string, pid func() (int, error)) *Target {
	t.Helper()
	tg := &Target{t: t, dir: data, bin: "/target"}
	for {
		if _, err := os.Stat(filepath.Join(data, "ready")); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the container's target is not ready: %v\n%s", ctx.Err(), tg.outputTail())
		case <-time.After(20 * time.Millisecond):
		}
	}
	tg.follow(t, pid)
	return tg
}

// follow points tg at its container's init, after a start or restore.
func (tg *Target) follow(t testing.TB, pid func() (int, error)) {
	t.Helper()
	p, err := pid()
	if err != nil {
		t.Fatal(err)
	}
	tg.pid = p
}

// proveContainer takes a proof of the target in a container and checks
// it against before: the same memory and PIDs (in the container), and
// the counter and the child advanced.
func proveContainer(ctx context.Context, t testing.TB, tg *Target, before Proof) Proof {
	t.Helper()
	p, err := tg.ProveAdvanced(ctx, before)
	if err != nil {
		t.Fatalf("restored container: %v", err)
	}
	return p
}

// cgroupOf is the cgroup path of pid in controller ctrl (cgroup v1).
func cgroupOf(t testing.TB, pid int, ctrl string) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.SplitN(l, ":", 3)
		if len(f) == 3 && (f[1] == ctrl || (ctrl == "" && f[1] == "")) {
			return f[2]
		}
	}
	return ""
}

// podmanImage imports a root file system with the target as a Podman
// image (no registry), removed when the test ends.
func podmanImage(ctx context.Context, t testing.TB, podman, dir string) string {
	t.Helper()
	rootfs := containerRootfs(t, dir)
	tarPath := filepath.Join(dir, "rootfs.tar")
	if err := tarDir(rootfs, tarPath); err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("localhost/gpucr-e2e-target:%d", os.Getpid())
	runtimeCmd(ctx, t, podman, "import", tarPath, name)
	t.Cleanup(func() { exec.Command(podman, "rmi", "--force", name).Run() })
	return name
}

// tarDir writes the tree under dir into a tar file.
func tarDir(dir, path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	err = filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil || p == dir {
			return err
		}
		h, err := tar.FileInfoHeader(fi, "")
		if err != nil {
			return err
		}
		h.Name, _ = filepath.Rel(dir, p)
		if err := tw.WriteHeader(h); err != nil || !fi.Mode().IsRegular() {
			return err
		}
		src, err := os.Open(p)
		if err != nil {
			return err
		}
		defer src.Close()
		_, err = io.Copy(tw, src)
		return err
	})
	if err == nil {
		err = tw.Close()
	}
	if err == nil {
		err = f.Close()
	}
	return err
}

// podmanRun starts the target in a Podman container named name, as
// Podman on this kind of machine needs it (no network, explicit ulimits),
// and removes it when the test ends.
func podmanRun(ctx context.Context, t testing.TB, podman, image, name, data string, mb int) *Target {
	t.Helper()
	args := append([]string{"run", "--detach", "--name", name, "--network", "none", "--ulimit", "nofile=1024:1024",
		"--ulimit", "nproc=4096:4096", "--volume", data + ":/data", image}, targetArgs(mb, "model")...)
	runtimeCmd(ctx, t, podman, args...)
	t.Cleanup(func() { exec.Command(podman, "rm", "--force", name).Run() })
	return containerTarget(ctx, t, data, func() (int, error) { return podmanPID(podman, name) })
}

// podmanPID is the host PID of container name's init, if it runs.
func podmanPID(podman, name string) (int, error) {
	out, err := exec.Command(podman, "container", "inspect", "--format", "{{.State.Status}} {{.State.Pid}}", name).Output()
	if err != nil {
		return 0, fmt.Errorf("podman inspect %s: %w", name, err)
	}
	status, pid, _ := strings.Cut(strings.TrimSpace(string(out)), " ")
	if status != "running" {
		return 0, errors.New("container " + name + " is " + status)
	}
	return strconv.Atoi(pid)
}

// RuncContainer starts the target (mb MiB) in a runc container under
// dir: its runc state dir and ID, and a pid func that finds its init.
func RuncContainer(ctx context.Context, t testing.TB, dir string, mb int) (tg *Target, root, id string, pid func() (int, error)) {
	t.Helper()
	runc := Runtime(t, "runc")
	root, data := filepath.Join(dir, "runc"), filepath.Join(dir, "data")
	for _, d := range []string{root, data} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	bundle := runcBundle(t, runc, filepath.Join(dir, "bundle"), data, targetArgs(mb, "model"))
	id = fmt.Sprintf("gcs-e2e-%d", os.Getpid())
	tg = startRunc(ctx, t, runc, root, bundle, id, data)
	return tg, root, id, func() (int, error) { return runcPID(runc, root, id) }
}

// Follow points tg at its container's init again, after a restore.
func (tg *Target) Follow(t testing.TB, pid func() (int, error)) { tg.follow(t, pid) }
