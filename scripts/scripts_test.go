// Package scripts holds tests of the shell scripts next to it.
package scripts

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestFuzzRetryIsQuiet: fuzz.sh repeats a run that ended on the fuzzer's
// own deadline without printing that run's FAIL lines, and still prints a
// real failure in full. A fake `go` plays the fuzzer.
func TestFuzzRetryIsQuiet(t *testing.T) {
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		runs    string // what each fuzz run prints and exits with, in turn
		code    int
		want    []string
		notWant []string
	}{
		{"deadline then ok", "deadline ok", 0, []string{"running it again", "ok  fake"}, []string{"FAIL"}},
		{"real crash", "crash", 1, []string{"--- FAIL: FuzzX", "testdata/fuzz/FuzzX"}, []string{"running it again"}},
		{"deadline twice", "deadline deadline", 1, []string{"running it again", "context deadline exceeded"}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			bin := t.TempDir()
			state := filepath.Join(bin, "runs")
			if err := os.WriteFile(state, []byte(strings.ReplaceAll(tc.runs, " ", "\n")+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			fake := `#!/bin/bash
case "$1 $2" in
"list ./...") echo example.com/fake; exit 0 ;;
"test -list") echo FuzzX; exit 0 ;;
esac
run=$(head -1 ` + state + `); sed -i 1d ` + state + `
case $run in
ok) echo "fuzz: elapsed: 1s"; echo "ok  fake 1.0s"; exit 0 ;;
deadline) echo "--- FAIL: FuzzX (10.01s)"; echo "    context deadline exceeded"; echo FAIL; exit 1 ;;
crash) echo "--- FAIL: FuzzX (0.20s)"; echo "    Failing input written to testdata/fuzz/FuzzX/abc"; echo FAIL; exit 1 ;;
esac
`
			if err := os.WriteFile(filepath.Join(bin, "go"), []byte(fake), 0o755); err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command("bash", filepath.Join(root, "scripts", "fuzz.sh"), "1s")
			cmd.Env = append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"))
			out, _ := cmd.CombinedOutput()
			if code := cmd.ProcessState.ExitCode(); code != tc.code {
				t.Errorf("exit %d, want %d:\n%s", code, tc.code, out)
			}
			for _, w := range tc.want {
				if !strings.Contains(string(out), w) {
					t.Errorf("output lacks %q:\n%s", w, out)
				}
			}
			for _, w := range tc.notWant {
				if strings.Contains(string(out), w) {
					t.Errorf("output has %q:\n%s", w, out)
				}
			}
		})
	}
}
