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

// TestTestRunsEveryStage: make test's script runs every stage whatever
// the earlier ones did, lists each stage's result and time and the failed
// tests of those that failed, and exits 1 when any failed (0 when none
// did). A fake make plays the stages.
func TestTestRunsEveryStage(t *testing.T) {
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		fail    string // stages the fake make fails
		code    int
		want    []string
		notWant []string
	}{
		{"all pass", "", 0, []string{"  ok      deps", "  ok      e2e"}, []string{"FAILED", "failed:"}},
		{"lint and e2e fail", "lint e2e", 1, []string{"  ok      deps", "  FAILED  lint", "  ok      unit", "  ok      fuzz", "  FAILED  e2e",
			"== lint failed:\nlint says no", "== e2e failed:\n--- FAIL: TestE2E"}, []string{"== unit failed"}},
		{"deps fail", "deps", 1, []string{"  FAILED  deps", "  ok      lint", "  ok      e2e"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			ran := filepath.Join(dir, "ran")
			fake := `#!/bin/bash
stage=$2
echo "$stage" >> ` + ran + `
case " ` + tc.fail + ` " in
*" $stage "*)
	if [ "$stage" = e2e ]; then echo "=== RUN   TestE2E"; echo "--- FAIL: TestE2E (1.0s)"; echo FAIL; else echo "$stage says no"; fi
	exit 2 ;;
esac
echo "$stage done"
`
			if err := os.WriteFile(filepath.Join(dir, "make"), []byte(fake), 0o755); err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command("bash", filepath.Join(root, "scripts", "test.sh"))
			cmd.Env = append(os.Environ(), "MAKE="+filepath.Join(dir, "make"))
			out, _ := cmd.CombinedOutput()
			if code := cmd.ProcessState.ExitCode(); code != tc.code {
				t.Errorf("exit %d, want %d:\n%s", code, tc.code, out)
			}
			b, _ := os.ReadFile(ran)
			if got := strings.Fields(string(b)); strings.Join(got, " ") != "deps lint unit fuzz e2e" {
				t.Errorf("ran %q, want every stage in order", got)
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
