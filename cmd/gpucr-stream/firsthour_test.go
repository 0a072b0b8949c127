package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
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
