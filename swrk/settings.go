package swrk

// What gpucr-stream, driving a runtime, tells the swrk the runtime starts:
// a file beside the streamer socket. A runtime passes its CRIU no
// environment of the caller's (Podman clears it), and the socket's
// directory is the one place both sides see.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// SettingsFile is read from the directory that holds the streamer socket
// (where a symlink of that name in the images dir points).
const SettingsFile = "gpucr-swrk.json"

// maxSettings bounds the file: a binary's path and some options.
const maxSettings = 1 << 20

// Settings say how CRIU's command line runs for a streamed request.
type Settings struct {
	// CRIU is the criu binary (empty: criu on PATH, never gpucr-stream).
	CRIU string `json:"criu,omitempty"`
	// Args are added to CRIU's command line after the request's options
	// (--criu-opts, a network lock method).
	Args []string `json:"criu_args,omitempty"`
	// Commit is the directory of a committer (criusock.AskCommit) that
	// commits the checkpoint at CRIU's post-dump, before the runtime
	// hears of it; its refusal fails the step, and CRIU resumes the tree.
	Commit string `json:"commit,omitempty"`
}

// WriteSettings writes s into dir, private to this user.
func WriteSettings(dir string, s Settings) error {
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	p := filepath.Join(dir, SettingsFile)
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("write %s: %w", p, err)
	}
	if err := os.Rename(tmp, p); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write %s: %w", p, err)
	}
	return nil
}

// readSettings reads dir's settings, if any. They name a binary to run
// and options for it, so they are taken only from a file and directory
// that this user owns and no one else may write: a symlink in an images
// dir (an imported archive may carry one) can point at any directory.
func readSettings(dir string) (Settings, error) {
	var s Settings
	p := filepath.Join(dir, SettingsFile)
	f, err := os.Open(p)
	if errors.Is(err, fs.ErrNotExist) {
		return s, nil
	}
	if err != nil {
		return s, fmt.Errorf("settings %s: %w", p, err)
	}
	defer f.Close()
	for _, c := range []struct {
		path string
		stat func() (os.FileInfo, error)
	}{{p, f.Stat}, {dir, func() (os.FileInfo, error) { return os.Stat(dir) }}} {
		st, err := c.stat()
		if err != nil {
			return s, fmt.Errorf("settings %s: %w", p, err)
		}
		sys, ok := st.Sys().(*syscall.Stat_t)
		if !ok || int(sys.Uid) != os.Geteuid() || st.Mode().Perm()&0o022 != 0 {
			return s, fmt.Errorf("settings %s: %s must belong to uid %d and be writable by it alone", p, c.path, os.Geteuid())
		}
	}
	b, err := io.ReadAll(io.LimitReader(f, maxSettings+1))
	if err != nil {
		return s, fmt.Errorf("settings %s: %w", p, err)
	}
	if len(b) > maxSettings {
		return s, fmt.Errorf("settings %s: over %d bytes", p, maxSettings)
	}
	if err := json.Unmarshal(b, &s); err != nil {
		return s, fmt.Errorf("settings %s: %w", p, err)
	}
	return s, nil
}
