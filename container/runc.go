package container

// runc: `runc checkpoint` and `runc restore` with --criu pointing at
// gpucr-stream, whose swrk streams what CRIU dumps and restores. runc
// itself does what it does with any CRIU: it writes descriptors.json into
// the images dir (carried), hands CRIU the container's mounts, namespaces
// and cgroups, and on restore puts the restored init into the container's
// cgroups and its state, so `runc list` shows it running.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/swrk"
)

type runc struct{ o Options }

// runcState is `runc state`'s answer.
type runcState struct {
	ID     string `json:"id"`
	PID    int    `json:"pid"`
	Status string `json:"status"`
	Bundle string `json:"bundle"`
}

func (r *runc) global() []string {
	if r.o.Root != "" {
		return []string{"--root", r.o.Root}
	}
	return nil
}

// state is the container's state, from runc's state file where that
// settles it (runcstate.go), else from `runc state`; errdefs.ErrNotFound
// if runc does not know the container.
func (r *runc) state(ctx context.Context, id string) (runcState, error) {
	if st, ok, err := r.stateFromFile(id); ok {
		return st, err
	}
	var st runcState
	out, _, err := command(ctx, "", r.o.Binary, append(r.global(), "state", id)...)
	if err != nil {
		if strings.Contains(err.Error(), "does not exist") {
			return st, fmt.Errorf("runc: no container %q: %w", id, errdefs.ErrNotFound)
		}
		return st, err
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		return st, fmt.Errorf("runc state %s: %w", id, err)
	}
	return st, nil
}

func (r *runc) forCheckpoint(ctx context.Context, id string) (int, criusock.Launcher, error) {
	st, err := r.state(ctx, id)
	if err != nil {
		return 0, nil, err
	}
	if st.Status != "running" || st.PID <= 0 {
		return 0, nil, errdefs.Usagef("runc: container %q is %s, not running", id, st.Status)
	}
	return st.PID, &runcLauncher{r: r, id: id, bundle: st.Bundle}, nil
}

func (r *runc) forRestore(ctx context.Context, name string) (criusock.Launcher, error) {
	if st, err := r.state(ctx, name); err == nil {
		return nil, errdefs.Usagef("runc: a container %q exists already (%s): restore under another name, or delete it first (runc delete)", name, st.Status)
	}
	return &runcLauncher{r: r, id: name, bundle: r.o.Bundle}, nil
}

// runcLauncher checkpoints container id, or restores one as id.
type runcLauncher struct {
	r      *runc
	id     string
	bundle string
}

// Carried: runc's record of the container's stdio, and whose it is.
func (l *runcLauncher) Carried() []string { return []string{descriptors, InfoFile} }

// PostDump: runc leaves nothing more to carry.
func (l *runcLauncher) PostDump(context.Context, string) error { return nil }

// logged runs a runc command that CRIU runs under, with its stdio on
// /dev/null and its messages in a log file: a restored container gets
// runc's stdio where descriptors.json records pipes, and a container must
// not keep a file of this process open (nor could CRIU dump one that lies
// outside its mounts). runc hands its environment to its CRIU, the swrk:
// x's CRIU version goes in it (swrk.VersionEnv).
func (r *runc) logged(ctx context.Context, x criusock.Launch, args ...string) (string, time.Duration, error) {
	log, err := os.CreateTemp("", "gpucr-runc-log-")
	if err != nil {
		return "", 0, err
	}
	defer os.Remove(log.Name())
	defer log.Close()
	cmd := exec.Command(r.o.Binary, append(append(r.global(), "--log", log.Name(), "--log-format", "text"), args...)...)
	cmd.Env = criuPath(x.CRIU)
	if env := swrk.VersionEnv(x.Version); env != "" {
		cmd.Env = append(cmd.Env, env)
	}
	start := time.Now()
	err = run(ctx, cmd)
	took := time.Since(start)
	b := make([]byte, maxOutput)
	n, _ := log.ReadAt(b, 0)
	if err != nil {
		return string(b[:n]), took, fmt.Errorf("runc %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(b[:n])))
	}
	return string(b[:n]), took, nil
}

func (l *runcLauncher) Dump(ctx context.Context, x criusock.Launch) (criusock.Launched, error) {
	if err := prepare(x, Info{Runtime: "runc", ID: l.id, Bundle: l.bundle}); err != nil {
		return criusock.Launched{}, err
	}
	args := []string{"--criu", l.r.o.Self, "checkpoint", "--image-path", x.ImagesDir, "--work-path", x.WorkDir}
	if x.LeaveRunning {
		args = append(args, "--leave-running")
	}
	out, took, err := l.r.logged(ctx, x, append(args, l.id)...)
	return criusock.Launched{Log: x.WorkDir + "/dump.log", Output: out, Took: took}, err
}

func (l *runcLauncher) Restore(ctx context.Context, x criusock.Launch) (criusock.Launched, error) {
	info, err := readInfo(x.ImagesDir)
	if err != nil {
		return criusock.Launched{}, err
	}
	bundle := l.bundle
	if bundle == "" {
		bundle = info.Bundle
	}
	if bundle == "" {
		return criusock.Launched{}, errdefs.Usagef("runc restore needs --bundle (the checkpoint of %s container %s names none)", info.Runtime, info.ID)
	}
	if _, err := os.Stat(bundle + "/config.json"); err != nil {
		return criusock.Launched{}, errdefs.Usagef("runc restore: bundle %s: %v", bundle, err)
	}
	if err := prepare(x, info); err != nil {
		return criusock.Launched{}, err
	}
	// Detached: runc returns once the container runs. Its stdio is what
	// descriptors.json records, /dev/null where that was a pipe (logged).
	out, took, err := l.r.logged(ctx, x, "--criu", l.r.o.Self, "restore", "--detach", "--image-path", x.ImagesDir,
		"--work-path", x.WorkDir, "--bundle", bundle, l.id)
	res := criusock.Launched{Log: x.WorkDir + "/restore.log", Output: out, Took: took}
	if err != nil {
		return res, err
	}
	st, err := l.r.state(ctx, l.id)
	if err != nil {
		return res, fmt.Errorf("runc restored %s, but: %w", l.id, err)
	}
	if st.Status != "running" {
		return res, fmt.Errorf("runc restored %s, but it is %s", l.id, st.Status)
	}
	res.PID = st.PID
	return res, nil
}
