package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
)

func TestParseSize(t *testing.T) {
	tests := []struct {
		in   string
		want int64
		bad  bool
	}{
		{"4MiB", 4 << 20, false}, {"256M", 256 << 20, false}, {"1G", 1 << 30, false}, {"1GiB", 1 << 30, false},
		{"65536", 65536, false}, {"64KiB", 64 << 10, false}, {"10B", 10, false},
		{"", 0, true}, {"-1M", 0, true}, {"lots", 0, true}, {"1.5G", 0, true},
	}
	for _, tc := range tests {
		got, err := parseSize(tc.in)
		if (err != nil) != tc.bad || (!tc.bad && got != tc.want) {
			t.Errorf("parseSize(%q) = %d, %v", tc.in, got, err)
		}
	}
}

func TestExitCodes(t *testing.T) {
	tests := []struct {
		err  error
		want int
	}{
		{nil, exitOK},
		{errors.New("disk full"), exitFailure},
		{usagef("bad flag"), exitUsage},
		{fmt.Errorf("serve: %w", errdefs.ErrCorrupt), exitCorrupt},
		{fmt.Errorf("x: %w", manifest.ErrNewerVersion), exitVersion},
		{fmt.Errorf("x: %w", errdefs.ErrNoRoom), exitNoRoom},
		{fmt.Errorf("x: %w", errdefs.ErrNotFound), exitNotFound},
		{context.Canceled, exitInterrupted},
		{fmt.Errorf("checkpoint 7: %w by SIGTERM: criu stopped the dump", errdefs.ErrInterrupted), exitInterrupted},
	}
	for _, tc := range tests {
		if got := exitCode(tc.err, false); got != tc.want {
			t.Errorf("exitCode(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
}

// Flags work before and after the command, as criu-image-streamer users
// write them, and bad ones are usage errors.
func TestRunArgs(t *testing.T) {
	tests := []struct {
		args    []string
		code    int
		stdout  string
		errText string
	}{
		{[]string{"version"}, exitOK, "gpucr-stream", ""},
		{[]string{"--help"}, exitOK, "$GPUCR_CODEC", ""},
		{[]string{}, exitUsage, "Usage", "no command"},
		{[]string{"frobnicate"}, exitUsage, "", "unknown command"},
		{[]string{"--codec", "brotli", "version"}, exitUsage, "", "--codec"},
		{[]string{"capture"}, exitUsage, "", "needs --images-dir"},
		{[]string{"--images-dir", "/dev/null/img", "serve"}, exitUsage, "", "not a directory"},
		{[]string{"capture", "--images-dir", "/dev/null/img"}, exitUsage, "", "not a directory"},
		{[]string{"--chunk-size", "1", "version"}, exitUsage, "", "--chunk-size"},
		{[]string{"--ext-file-fds", "nocolon", "capture"}, exitUsage, "", "NAME:FD"},
		{[]string{"--ext-file-fds", "nocolon", "version"}, exitUsage, "", "version does not take --ext-file-fds"},
		{[]string{"checkpoint"}, exitUsage, "", "--pid"},
		{[]string{"checkpoint", "--pid", "1", "--fast-path", "on"}, exitUsage, "", "--fast-path"},
		{[]string{"checkpoint", "--pid", "1", "--vram-files", "0"}, exitUsage, "", "--vram-files"},
		{[]string{"run"}, exitUsage, "", "run needs a program"},
		{[]string{"run", "--"}, exitUsage, "", "run needs a program"},
		{[]string{"inspect", "/nonexistent/archive"}, exitNotFound, "", "inspect: /nonexistent/archive: no such directory"},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var out, errOut bytes.Buffer
			err := run(context.Background(), tc.args, strings.NewReader(""), &out, &errOut)
			if got := exitCode(err, false); got != tc.code {
				t.Fatalf("exit %d (%v), want %d", got, err, tc.code)
			}
			if !strings.Contains(out.String(), tc.stdout) {
				t.Errorf("stdout lacks %q: %s", tc.stdout, out.String())
			}
			if tc.errText != "" && (err == nil || !strings.Contains(err.Error(), tc.errText)) {
				t.Errorf("error %v lacks %q", err, tc.errText)
			}
		})
	}
}

// Each command owns its flags: one another command takes is refused
// (exit 2, naming it), and COMMAND --help lists that command's flags only.
func TestCommandFlags(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		args    []string
		code    int
		stdout  string
		notOut  string
		errText string
	}{
		{[]string{"ls", dir, "--pid", "42", "--streams", "3"}, exitUsage, "", "", "ls does not take --pid, --streams"},
		{[]string{"--pid", "42", "token"}, exitUsage, "", "", "token does not take --pid"},
		{[]string{"run", "--pid", "42", "--", "true"}, exitUsage, "", "", "run does not take --pid"},
		{[]string{"restore", "--fast-path", "off"}, exitUsage, "", "", "restore does not take --fast-path"},
		{[]string{"gpu", "--help"}, exitOK, "--vram-keep-dir", "--older-than", ""},
		{[]string{"ls", "--help"}, exitOK, "--s3-endpoint", "--pid", ""},
		{[]string{"capture", "--help"}, exitOK, "--images-dir", "--older-than", ""},
		{[]string{"--help", "gc"}, exitOK, "--older-than", "--codec", ""},
		{[]string{"check", "--help"}, exitOK, "--repair-index", "--dry-run", ""},
		{[]string{"gc", dir, "--read-data"}, exitUsage, "", "", "gc does not take --read-data"},
		{[]string{"version", "--json"}, exitOK, "gpucr-stream", "", ""},
		// each command's help lists the flags it uses, no others
		{[]string{"keygen", "--help"}, exitOK, "--help", "--progress-fd", ""},
		{[]string{"token", "--help"}, exitOK, "--help", "--progress-fd", ""},
		{[]string{"verify", "--help"}, exitOK, "--key-file", "--tls-", ""},
		{[]string{"verify", "--help"}, exitOK, "--s3-parallel", "--token-file", ""},
		{[]string{"verify", "--help"}, exitOK, "--json", "--streams", ""},
		{[]string{"receive", "--help"}, exitOK, "--token-file", "--streams", ""},
		{[]string{"restore", "--help"}, exitOK, "--tls-ca", "--streams", ""},
		{[]string{"ls", "--help"}, exitOK, "--json", "--s3-part-size", ""},
		{[]string{"rm", "--help"}, exitOK, "--dry-run", "--s3-part-size", ""},
		{[]string{"checkpoint", "--help"}, exitOK, "--progress-fd", "checkpoint/restore:", ""},
		{[]string{"serve", "--help"}, exitOK, "--from", "capture/serve:", ""},
		// drivers pass --progress-fd to every command: still taken
		{[]string{"keygen", "--progress-fd", "2"}, exitOK, "", "", ""},
		// usage errors in the command's own terms
		{[]string{"checkpoint", "--pid", "abc"}, exitUsage, "", "", `--pid "abc": not a whole number`},
		{[]string{"ls", "--dry-run=maybe"}, exitUsage, "", "", `--dry-run "maybe": not true or false`},
		{[]string{"ls", "--frobnicate"}, exitUsage, "", "", "unknown flag --frobnicate"},
		{[]string{"ls", "s3://"}, exitUsage, "", "", "ls: location s3://: no bucket"},
		{[]string{"inspect", "--from", dir, dir + "/b"}, exitUsage, "", "", "give SRC once"},
		{[]string{"verify", "tcp://127.0.0.1:1"}, exitUsage, "", "", "at rest"},
		// migrate streams to its receiver: no archive's flags (issue 38)
		{[]string{"migrate", "--pid", "1", "--to", "tcp://127.0.0.1:1", "--dedup", "--segment-size", "1GiB", "--bundle", dir}, exitUsage, "", "",
			"migrate does not take --bundle, --dedup, --segment-size"},
		{[]string{"checkpoint", "--pid", "1", "--bundle", dir}, exitUsage, "", "", "checkpoint does not take --bundle"},
		{[]string{"cp", dir}, exitUsage, "", "", "cp takes SRC and DEST, got 1 argument"},
		{[]string{"cp", dir, dir, dir}, exitUsage, "", "", "got 3 arguments"},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var out, errOut bytes.Buffer
			err := run(context.Background(), tc.args, strings.NewReader(""), &out, &errOut)
			if got := exitCode(err, false); got != tc.code {
				t.Fatalf("exit %d (%v), want %d", got, err, tc.code)
			}
			if !strings.Contains(out.String(), tc.stdout) {
				t.Errorf("stdout lacks %q: %s", tc.stdout, out.String())
			}
			if tc.notOut != "" && strings.Contains(out.String(), tc.notOut) {
				t.Errorf("stdout has %q: %s", tc.notOut, out.String())
			}
			if tc.errText != "" && (err == nil || !strings.Contains(err.Error(), tc.errText)) {
				t.Errorf("error %v lacks %q", err, tc.errText)
			}
			if err != nil && strings.Contains(err.Error(), tc.args[0]+": "+tc.args[0]+":") {
				t.Errorf("error %v names the command twice", err)
			}
		})
	}
}

// Every command's help starts the flags' descriptions in one column, the
// longest names (--s3-sse-key-file) included.
func TestHelpColumns(t *testing.T) {
	for _, c := range commands() {
		var out bytes.Buffer
		if err := run(context.Background(), []string{c.name, "--help"}, strings.NewReader(""), &out, &out); err != nil {
			t.Fatal(err)
		}
		col := -1
		for _, l := range strings.Split(out.String(), "\n") {
			if !strings.HasPrefix(l, "  -") {
				continue
			}
			i := strings.Index(l, "--")
			i += strings.Index(l[i:], " ")
			at := i + len(l[i:]) - len(strings.TrimLeft(l[i:], " "))
			if col < 0 {
				col = at
			}
			if at != col || at-i < 2 {
				t.Errorf("%s --help: %q: description at column %d, others at %d", c.name, l, at, col)
			}
		}
	}
}

// The profile's command is found behind global flags: `--images-dir DIR
// capture` once named every profile "--images-dir", so that serve's
// overwrote capture's, and `--json run` would have profiled a target.
func TestCommandOf(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"capture", "--codec", "none"}, "capture"},
		{[]string{"--images-dir", "/tmp/x", "--progress-fd", "3", "serve", "--from", "a"}, "serve"},
		{[]string{"--json", "run", "--", "python3"}, "run"},
		{[]string{"--version"}, "none"},
		{nil, "none"},
	} {
		if got := commandOf(tc.args); got != tc.want {
			t.Errorf("commandOf(%q) = %q, want %q", tc.args, got, tc.want)
		}
	}
}
