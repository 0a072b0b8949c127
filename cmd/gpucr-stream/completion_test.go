package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestBashCompletion runs the script in bash: commands, a command's own
// flags (not another's), and the short options' long forms.
func TestBashCompletion(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"completion", "bash"}, strings.NewReader(""), &out, &out); err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(t.TempDir(), "gpucr-stream.bash")
	if err := os.WriteFile(script, out.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		words   string
		want    []string
		notWant []string
	}{
		{"gpucr-stream ca", []string{"capture"}, []string{"serve"}},
		{"gpucr-stream -D /tmp/x se", []string{"serve"}, nil},
		{"gpucr-stream serve --tcp", []string{"--tcp-listen-remap"}, nil},
		{"gpucr-stream checkpoint --", []string{"--pid", "--to", "--criu-opts"}, []string{"--tcp-listen-remap", "--from"}},
		{"gpucr-stream --ver", []string{"--version"}, nil},
		{"gpucr-stream chec", []string{"check", "checkpoint"}, nil},
		{"gpucr-stream check --", []string{"--repair-index", "--read-data", "--key-file"}, []string{"--dry-run", "--pid"}},
	}
	for _, tc := range tests {
		words := strings.Fields(tc.words)
		cmd := exec.Command("bash", "-c", `source "$1"; COMP_WORDS=(${2}); COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); _gpucr_stream; printf '%s\n' "${COMPREPLY[@]}"`, "bash", script, strings.Join(words, " "))
		got, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v: %s", tc.words, err, got)
		}
		lines := strings.Fields(string(got))
		has := func(w string) bool {
			for _, l := range lines {
				if l == w {
					return true
				}
			}
			return false
		}
		for _, w := range tc.want {
			if !has(w) {
				t.Errorf("%q completes to %v, want %s among them", tc.words, lines, w)
			}
		}
		for _, w := range tc.notWant {
			if has(w) {
				t.Errorf("%q completes to %v, which has %s", tc.words, lines, w)
			}
		}
	}
}
