package criusock

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestFinishWorkDir: a temporary work dir goes after a success and after
// a failure that is not CRIU's; after CRIU's own it stays with CRIU's logs
// only (no FIFOs, no scripts), named in the error; a given one is never
// removed.
func TestFinishWorkDir(t *testing.T) {
	tests := []struct {
		name      string
		err       error
		temporary bool
		kept      bool
		says      string
	}{
		{"temporary, ok", nil, true, false, ""},
		{"temporary, criu failed", criuFailed{errors.New("criu dump: exit status 1")}, true, true, "criu's log is kept in"},
		{"temporary, the destination failed", errors.New("capture failed, so criu dump failed"), true, false, ""},
		{"temporary, interrupted", context.Canceled, true, false, ""},
		{"temporary, criu failed without a log", criuFailed{errors.New("criu dump: exit status 1")}, true, false, ""},
		{"given, failed", criuFailed{errors.New("criu dump: exit status 1")}, false, true, ""},
		{"given, ok", nil, false, true, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir, _, cleanup, err := workDirs("")
			if err != nil {
				t.Fatal(err)
			}
			defer os.RemoveAll(dir)
			if !tc.temporary {
				cleanup = func() {} // as workDirs makes it for a given dir
			}
			// What a dump leaves there: CRIU's log, the commit FIFOs and
			// the action script.
			if !strings.Contains(tc.name, "without a log") {
				if err := os.WriteFile(filepath.Join(dir, "img", "dump.log"), []byte("Error"), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			cm, err := newCommitter(dir)
			if err != nil {
				t.Fatal(err)
			}
			cm.close()
			err = finishWorkDir(tc.err, dir, tc.temporary, cleanup)
			if !errors.Is(err, tc.err) {
				t.Errorf("error %v does not wrap %v", err, tc.err)
			}
			_, statErr := os.Stat(filepath.Join(dir, "img"))
			if kept := statErr == nil; kept != tc.kept {
				t.Errorf("kept %v, want %v", kept, tc.kept)
			}
			if tc.says != "" && !strings.Contains(err.Error(), tc.says+" "+dir) {
				t.Errorf("error %q does not name %s", err, dir)
			}
			if tc.kept && tc.temporary {
				var left []string
				filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
					if err == nil && !d.IsDir() {
						left = append(left, strings.TrimPrefix(p, dir))
					}
					return nil
				})
				if strings.Join(left, " ") != "/img/dump.log" {
					t.Errorf("kept %q, want CRIU's log alone", left)
				}
			}
		})
	}
}

// TestShellJobHint: CRIU's complaints about a terminal get the hint in
// gpucr-stream's terms.
func TestShellJobHint(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		log  string
		hint bool
	}{
		{"(00.01) Error (criu/tty.c:2178): tty: Found dangling tty with sid 7 pgid 7 (pts) on peer fd 0.\n(00.01) Task attached to shell terminal. Consider using --shell-job option.\n", true},
		{"(00.02) Error (criu/tty.c:1023): tty: Don't have tty to inherit session from, aborting\n", true},
		{"(00.03) Error (criu/tty.c:410): tty: Found slave peer index 0 without correspond master peer\n", true},
		{"(00.02) Error (criu/cr-dump.c:2093): Dumping FAILED.\n", false},
	}
	for i, tc := range tests {
		p := filepath.Join(dir, "dump.log")
		if err := os.WriteFile(p, []byte(tc.log), 0o644); err != nil {
			t.Fatal(err)
		}
		msg := criuLogTail(p, "")
		if got := strings.Contains(msg, "--criu-opts --shell-job"); got != tc.hint {
			t.Errorf("%d: hint %v in %q, want %v", i, got, msg, tc.hint)
		}
		if !strings.Contains(msg, p) {
			t.Errorf("%d: %q does not name the log", i, msg)
		}
	}
}

// TestNoLogNoPath: a CRIU that failed before it wrote its log (an option
// it does not know) is reported by its output, and the error names no log
// (the work dir, with no log to keep, is removed).
func TestNoLogNoPath(t *testing.T) {
	dir, _, cleanup, err := workDirs("")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	logPath := filepath.Join(dir, "img", "dump.log")
	out := "criu: unrecognized option '--no-such-option'"
	err = finishWorkDir(criuFailed{fmt.Errorf("criu dump: exit status 1; %s", criuLogTail(logPath, out))}, dir, true, cleanup)
	if !strings.Contains(err.Error(), out) {
		t.Errorf("error %q does not give criu's output", err)
	}
	if strings.Contains(err.Error(), dir) {
		t.Errorf("error %q names %s, which is removed", err, dir)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("the work dir is kept: %v", err)
	}
}
