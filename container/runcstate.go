package container

// A runc container's state read from runc's own state file, as `runc
// state` works it out (runc 1.1, libcontainer: loadState, refreshState,
// runType), without starting runc: a checkpoint asks for it before the
// dump and a restore before and after, each `runc state` 6-13 ms here.
// Whatever the file does not settle (a root that is not known, an ID runc
// would refuse, a file or freezer state this does not read as runc does)
// is left to `runc state`.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/proc"
)

// runcStateFile is what this reads of runc's state.json (libcontainer's
// State).
type runcStateFile struct {
	ID               string `json:"id"`
	InitProcessPid   int    `json:"init_process_pid"`
	InitProcessStart uint64 `json:"init_process_start"`
	Config           struct {
		Labels []string `json:"labels"`
	} `json:"config"`
	CgroupPaths map[string]string `json:"cgroup_paths"`
}

// runcID is an ID runc takes (libcontainer's validateID); any other is
// left to runc, to refuse in its words.
var runcID = regexp.MustCompile(`^[\w+\-.]+$`)

// maxStateFile bounds state.json: a container's configuration, some KiB.
const maxStateFile = 16 << 20

// root is runc's state directory: --runtime-root, else runc's default
// as runc picks it (main.go: /run/runc, or $XDG_RUNTIME_DIR/runc where
// runc honours it); "" where that is not known here.
func (r *runc) root() string {
	if r.o.Root != "" {
		return r.o.Root
	}
	if os.Geteuid() == 0 && (os.Getenv("XDG_RUNTIME_DIR") == "" || !inUserNS()) {
		return "/run/runc"
	}
	return ""
}

// inUserNS says whether this process runs in a user namespace
// (libcontainer's userns.RunningInUserNS); unsure counts as yes.
func inUserNS() bool {
	b, err := os.ReadFile("/proc/self/uid_map")
	if err != nil {
		return true
	}
	f := strings.Fields(string(b))
	return !(len(f) == 3 && f[0] == "0" && f[1] == "0" && f[2] == "4294967295")
}

// stateFromFile is the container's state as `runc state` would give it,
// and whether the files settled it; a container that does not exist is
// errdefs.ErrNotFound.
func (r *runc) stateFromFile(id string) (runcState, bool, error) {
	root := r.root()
	if root == "" || !runcID.MatchString(id) || id == "." || id == ".." {
		return runcState{}, false, nil
	}
	b, err := readBounded(filepath.Join(root, id, "state.json"), maxStateFile)
	if errors.Is(err, fs.ErrNotExist) {
		return runcState{}, true, fmt.Errorf("runc: no container %q: %w", id, errdefs.ErrNotFound)
	}
	var f runcStateFile
	if err != nil || json.Unmarshal(b, &f) != nil || f.ID != id {
		return runcState{}, false, nil
	}
	status, ok := runcStatus(filepath.Join(root, id), f)
	if !ok {
		return runcState{}, false, nil
	}
	st := runcState{ID: id, PID: f.InitProcessPid, Status: status}
	for _, l := range f.Config.Labels {
		if b, ok := strings.CutPrefix(l, "bundle="); ok {
			st.Bundle = b
		}
	}
	if status == "stopped" {
		st.PID = 0 // as runc state says it
	}
	return st, true, nil
}

// runcStatus is the container's status as runc works it out: paused
// where its freezer cgroup is frozen, else stopped where its init is gone
// (or its PID is another process's now), created where runc still waits
// to start it (exec.fifo), else running. ok is false where a freezer
// state is not one this reads as runc does.
func runcStatus(dir string, f runcStateFile) (status string, ok bool) {
	frozen, ok := runcFrozen(f.CgroupPaths)
	if !ok {
		return "", false
	}
	if frozen {
		return "paused", true
	}
	start, state := proc.StartTime(f.InitProcessPid)
	if f.InitProcessPid <= 0 || start == 0 || start != f.InitProcessStart || state == 'Z' || state == 'X' {
		return "stopped", true
	}
	if _, err := os.Lstat(filepath.Join(dir, "exec.fifo")); err == nil {
		return "created", true
	}
	return "running", true
}

// runcFrozen reads the container's freezer as runc's cgroup manager
// does: cgroup v2's cgroup.freeze where /sys/fs/cgroup is cgroup2, else
// v1's freezer.state (FROZEN counting only where the cgroup itself is
// frozen, not an ancestor). A cgroup or file that is not there is not
// frozen (runc: undefined).
func runcFrozen(paths map[string]string) (frozen, ok bool) {
	var sfs unix.Statfs_t
	if err := unix.Statfs("/sys/fs/cgroup", &sfs); err != nil {
		return false, false
	}
	if sfs.Type == unix.CGROUP2_SUPER_MAGIC {
		v, ok := readCgroup(paths[""], "cgroup.freeze")
		return v == "1", ok
	}
	v, ok := readCgroup(paths["freezer"], "freezer.state")
	switch {
	case !ok || v == "" || v == "THAWED":
		return false, ok
	case v == "FROZEN":
		self, ok := readCgroup(paths["freezer"], "freezer.self_freezing")
		return self == "1", ok
	}
	return false, false // FREEZING: runc waits for it to settle
}

// readCgroup is a cgroup file's first line; "" where the cgroup or the
// file is not there, ok false where it could not be read.
func readCgroup(dir, name string) (string, bool) {
	if dir == "" {
		return "", true
	}
	b, err := readBounded(filepath.Join(dir, name), 4096)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ENODEV) {
		return "", true
	}
	if err != nil {
		return "", false
	}
	line, _, _ := strings.Cut(string(b), "\n")
	return strings.TrimSpace(line), true
}

// readBounded reads a file of at most limit bytes.
func readBounded(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err == nil && int64(len(b)) > limit {
		err = fmt.Errorf("%s: over %d bytes", path, limit)
	}
	return b, err
}
