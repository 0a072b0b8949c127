// Command testsum runs `go test -json ARGS...` and prints one line as each
// top-level test starts and ends, so that long end-to-end runs are never
// silent; the whole output of a test is printed only when it fails (or with
// -v). It exits with go test's status. `make e2e` uses it.
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
)

// event is one line of test2json's output.
type event struct {
	Action  string
	Package string
	Test    string
	Elapsed float64
	Output  string
}

func main() {
	verbose := flag.Bool("v", false, "print every test's output, not only failed tests'")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: testsum [-v] [--] GO-TEST-ARGS...")
	}
	flag.Parse()
	cmd := exec.Command("go", append([]string{"test", "-json"}, flag.Args()...)...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		fmt.Fprintln(os.Stderr, "testsum:", err)
		os.Exit(1)
	}
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "testsum:", err)
		os.Exit(1)
	}
	summarize(out, os.Stdout, *verbose)
	err = cmd.Wait()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		os.Exit(ee.ExitCode())
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "testsum:", err)
		os.Exit(1)
	}
}

// summarize turns test2json events into the short report.
func summarize(r io.Reader, w io.Writer, verbose bool) {
	logs := map[string]*strings.Builder{} // by top-level test, subtests included
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		var ev event
		if json.Unmarshal(sc.Bytes(), &ev) != nil {
			fmt.Fprintln(w, sc.Text()) // not JSON: a build error, say
			continue
		}
		top, _, sub := strings.Cut(ev.Test, "/")
		switch {
		case ev.Test == "" && ev.Action == "output":
			// Package-level lines: ok/FAIL summaries, panics outside tests.
			if !strings.HasPrefix(ev.Output, "=== ") && ev.Output != "PASS\n" && ev.Output != "FAIL\n" {
				fmt.Fprint(w, ev.Output)
			}
		case ev.Test == "":
		case ev.Action == "run" && !sub:
			logs[top] = &strings.Builder{}
			fmt.Fprintf(w, "=== RUN   %s\n", top)
		case ev.Action == "output":
			if b := logs[top]; b != nil {
				b.WriteString(ev.Output)
			}
		case !sub && (ev.Action == "pass" || ev.Action == "fail" || ev.Action == "skip"):
			b := logs[top]
			delete(logs, top)
			if b == nil {
				b = &strings.Builder{}
			}
			if ev.Action == "fail" || verbose {
				fmt.Fprint(w, b.String())
			}
			res := map[string]string{"pass": "PASS", "fail": "FAIL", "skip": "SKIP"}[ev.Action]
			fmt.Fprintf(w, "--- %s: %s (%.1fs)%s\n", res, top, ev.Elapsed, skipReason(ev.Action, b.String()))
		}
	}
}

// skipReason is the last line a skipped test logged, which says why.
func skipReason(action, log string) string {
	if action != "skip" {
		return ""
	}
	lines := strings.Split(strings.TrimSpace(log), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if l := strings.TrimSpace(lines[i]); l != "" && !strings.HasPrefix(l, "---") && !strings.HasPrefix(l, "===") {
			return ": " + l
		}
	}
	return ""
}
