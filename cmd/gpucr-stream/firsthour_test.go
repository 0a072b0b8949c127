package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestFirstHour: what a new user ran into in the first hour, as table
// cases of the command line.
func TestFirstHour(t *testing.T) {
	tests := []struct {
		name string
		args []string
		code int
		err  string
	}{
		{"checkpoint of a process that does not exist", []string{"checkpoint", "--pid", "999999999", "--to", "DIR/ck"}, exitNotFound, "no process 999999999"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			args := append([]string(nil), tc.args...)
			for i := range args {
				args[i] = strings.ReplaceAll(args[i], "DIR", dir)
			}
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), args, strings.NewReader(""), &stdout, &stderr)
			if code := exitCode(err, false); code != tc.code {
				t.Fatalf("exit %d (%v), want %d", code, err, tc.code)
			}
			if tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
				t.Errorf("error %v lacks %q", err, tc.err)
			}
		})
	}
}

// openPTY returns the terminal side of a new pseudo-terminal.
func openPTY(t *testing.T) *os.File {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatalf("no pseudo-terminal: %v", err)
	}
	t.Cleanup(func() { m.Close() })
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	s, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// TestRefuseTerminal: a binary stream is not written to a terminal
// (capture, checkpoint); elsewhere, or with --to, the same commands go on.
func TestRefuseTerminal(t *testing.T) {
	tty := openPTY(t)
	dir := t.TempDir()
	tests := []struct {
		name   string
		args   []string
		stdout *os.File
		code   int
	}{
		{"capture to a terminal", []string{"--images-dir", dir + "/a", "capture"}, tty, exitUsage},
		{"checkpoint to a terminal", []string{"checkpoint", "--pid", fmt.Sprint(os.Getpid())}, tty, exitUsage},
		{"capture --to a dir, terminal stdout", []string{"--images-dir", dir + "/b", "--connect-timeout", "100ms", "capture", "--to", dir + "/ck"}, tty, exitFailure},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var stderr bytes.Buffer
			err := run(context.Background(), tc.args, strings.NewReader(""), tc.stdout, &stderr)
			if code := exitCode(err, false); code != tc.code {
				t.Fatalf("exit %d (%v), want %d", code, err, tc.code)
			}
			if tc.code == exitUsage && !strings.Contains(err.Error(), "terminal") {
				t.Errorf("error %q does not say why", err)
			}
		})
	}
	if _, err := os.Stat(dir + "/a"); err == nil {
		t.Error("the refused capture created its images dir")
	}
}
