// Package container checkpoints and restores containers through their
// runtime, so that the runtime manages the restored container (its
// cgroups, `runc list` / `podman ps`, a later checkpoint). The runtime is
// pointed at gpucr-stream as its CRIU (`runc --criu`, Podman's
// --runtime-flag criu=), whose swrk (package swrk) streams the dump or
// restore through the capture or serve that package capture runs in the
// images dir. Each runtime is a criusock.Launcher: runc (runc.go) and
// Podman (podman.go), whose OCI runtime is runc.
package container

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/swrk"
)

// Options say which runtime manages the container and how to reach it.
type Options struct {
	// Runtime is "runc" (the default) or "podman".
	Runtime string
	// Binary is the runtime's program (default: its name on PATH).
	Binary string
	// Root is runc's state directory (runc --root; default runc's).
	Root string
	// Bundle is the OCI bundle a runc container is restored from
	// (default: the one it was checkpointed from).
	Bundle string
	// Self is the gpucr-stream program the runtime runs as its CRIU
	// (default: gpucr-stream-swrk where it lies beside this program, as
	// this program's name and "-swrk"; else this program).
	Self string
}

// InfoFile is the carried file that says which container a checkpoint
// holds: its runtime, ID and (runc) bundle, the defaults of its restore.
const InfoFile = "container.json"

// Info is InfoFile's content.
type Info struct {
	Runtime string `json:"runtime"`
	ID      string `json:"id"`
	Name    string `json:"name,omitempty"`
	Bundle  string `json:"bundle,omitempty"`
	Image   string `json:"image,omitempty"`
}

// ForCheckpoint finds the running container id and returns its init's PID
// (the root of the tree checkpointed) and the launcher that checkpoints it
// through its runtime.
func ForCheckpoint(ctx context.Context, o Options, id string) (int, criusock.Launcher, error) {
	rt, err := open(o)
	if err != nil {
		return 0, nil, err
	}
	return rt.forCheckpoint(ctx, id)
}

// ForRestore returns the launcher that restores a checkpoint as container
// name, which its runtime then manages.
func ForRestore(ctx context.Context, o Options, name string) (criusock.Launcher, error) {
	rt, err := open(o)
	if err != nil {
		return nil, err
	}
	return rt.forRestore(ctx, name)
}

// runtime is one runtime's side.
type runtime interface {
	forCheckpoint(ctx context.Context, id string) (int, criusock.Launcher, error)
	forRestore(ctx context.Context, name string) (criusock.Launcher, error)
}

// swrkBeside is gpucr-stream-swrk where it lies beside the program self
// (named as self and "-swrk"), else self: the swrk alone
// (cmd/gpucr-stream-swrk) starts in half the time, twice a checkpoint.
func swrkBeside(self string) string {
	sw := self + "-swrk"
	if st, err := os.Stat(sw); err == nil && st.Mode().IsRegular() && st.Mode().Perm()&0o111 != 0 {
		return sw
	}
	return self
}

func open(o Options) (runtime, error) {
	if o.Self == "" {
		self, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("container: this program's path: %w", err)
		}
		o.Self = swrkBeside(self)
	}
	switch o.Runtime {
	case "", "runc":
		if o.Binary == "" {
			o.Binary = "runc"
		}
		return &runc{o: o}, nil
	case "podman":
		if o.Binary == "" {
			o.Binary = "podman"
		}
		if o.Root != "" || o.Bundle != "" {
			return nil, errdefs.Usagef("--runtime podman: --runtime-root and --bundle are runc's (Podman knows its containers)")
		}
		return &podman{o: o}, nil
	}
	return nil, errdefs.Usagef("--runtime %q: want runc or podman (crun is built without CRIU on Debian: docs/CONTAINERS.md)", o.Runtime)
}

// command runs a runtime command and returns its standard output; its
// error carries the standard error. CRIU is found on PATH by the swrk
// the runtime starts (Podman passes the runtime only PATH), so the
// directory of the real criu goes first. The output goes through files,
// not pipes: a restored container may inherit the runtime's stdio (runc
// hands CRIU its own for the pipes descriptors.json records), and would
// hold a pipe open, and this command with it, as long as it runs.
func command(ctx context.Context, criu, bin string, args ...string) (string, time.Duration, error) {
	cmd := exec.Command(bin, args...)
	cmd.Env = criuPath(criu)
	var files [2]*os.File
	for i := range files {
		f, err := os.CreateTemp("", "gpucr-runtime-")
		if err != nil {
			return "", 0, err
		}
		os.Remove(f.Name())
		defer f.Close()
		files[i] = f
	}
	cmd.Stdout, cmd.Stderr = files[0], files[1]
	start := time.Now()
	err := run(ctx, cmd)
	took := time.Since(start)
	var text [2]string
	for i, f := range files {
		b := make([]byte, maxOutput)
		n, _ := f.ReadAt(b, 0)
		text[i] = string(b[:n])
	}
	if err != nil {
		return text[0], took, fmt.Errorf("%s %s: %w: %s", bin, strings.Join(args, " "), err, strings.TrimSpace(text[1]))
	}
	return text[0], took, nil
}

// run runs cmd. When ctx ends first, the runtime is not killed at once:
// the capture or serve it works for has failed CRIU's streams, so CRIU
// fails, cleans up (resumes a dumped container) and the runtime returns;
// only after criusock.InterruptGrace is it killed.
func run(ctx context.Context, cmd *exec.Cmd) error {
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	grace := time.NewTimer(criusock.InterruptGrace)
	defer grace.Stop()
	select {
	case err := <-done:
		return err
	case <-grace.C:
		cmd.Process.Kill()
		<-done
		return fmt.Errorf("%s killed: it did not stop within %v of %v", cmd.Path, criusock.InterruptGrace, context.Cause(ctx))
	}
}

// criuPath is the environment with criu's directory first on PATH.
func criuPath(criu string) []string {
	env := os.Environ()
	if criu != "" {
		env = append(env, "PATH="+filepath.Dir(criu)+string(os.PathListSeparator)+os.Getenv("PATH"))
	}
	return env
}

// maxOutput bounds what is read of a runtime's output.
const maxOutput = 1 << 20

// prepare writes what the swrk the runtime starts reads beside the
// streamer socket (the real criu, the options to add) and the container's
// info, both into the images dir.
func prepare(l criusock.Launch, info Info) error {
	if err := swrk.WriteSettings(l.ImagesDir, swrk.Settings{CRIU: l.CRIU, Args: l.Args, Commit: l.Commit}); err != nil {
		return err
	}
	b, err := json.Marshal(info)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(l.ImagesDir, InfoFile), b, 0o600)
}

// readInfo reads the container info a restore wrote into the images dir.
func readInfo(dir string) (Info, error) {
	var info Info
	b, err := os.ReadFile(filepath.Join(dir, InfoFile))
	if err != nil {
		return info, fmt.Errorf("the checkpoint holds no container (%s): %w", InfoFile, err)
	}
	if err := json.Unmarshal(b, &info); err != nil {
		return info, fmt.Errorf("%s: %w", InfoFile, err)
	}
	return info, nil
}
