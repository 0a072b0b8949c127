package main

import (
	"strings"
	"testing"
)

func TestSummarize(t *testing.T) {
	ev := func(action, test, output string) string {
		return `{"Action":"` + action + `","Package":"p","Test":"` + test + `","Elapsed":1.5,"Output":` + quote(output) + `}`
	}
	in := strings.Join([]string{
		ev("run", "TestA", ""),
		ev("output", "TestA", "=== RUN   TestA\n"),
		ev("output", "TestA", "    a_test.go:1: quiet detail\n"),
		ev("pass", "TestA", ""),
		ev("run", "TestB", ""),
		ev("run", "TestB/sub", ""),
		ev("output", "TestB/sub", "    b_test.go:9: the reason it broke\n"),
		ev("fail", "TestB/sub", ""),
		ev("fail", "TestB", ""),
		ev("run", "TestC", ""),
		ev("output", "TestC", "    c_test.go:3: needs root\n"),
		ev("skip", "TestC", ""),
		ev("output", "", "FAIL\n"),
		ev("output", "", "FAIL\tp\t3.0s\n"),
		"# p [build failed]",
	}, "\n")
	tests := []struct {
		verbose bool
		want    []string
		notWant []string
	}{
		{false, []string{"=== RUN   TestA\n", "--- PASS: TestA (1.5s)", "=== RUN   TestB\n", "the reason it broke", "--- FAIL: TestB (1.5s)",
			"--- SKIP: TestC (1.5s): c_test.go:3: needs root", "FAIL\tp\t3.0s", "# p [build failed]"}, []string{"quiet detail", "RUN   TestB/sub"}},
		{true, []string{"quiet detail", "the reason it broke"}, nil},
	}
	for _, tc := range tests {
		var out strings.Builder
		summarize(strings.NewReader(in), &out, tc.verbose)
		for _, w := range tc.want {
			if !strings.Contains(out.String(), w) {
				t.Errorf("verbose=%v: output lacks %q:\n%s", tc.verbose, w, out.String())
			}
		}
		for _, w := range tc.notWant {
			if strings.Contains(out.String(), w) {
				t.Errorf("verbose=%v: output has %q:\n%s", tc.verbose, w, out.String())
			}
		}
	}
}

func quote(s string) string {
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`, "\t", `\t`)
	return `"` + r.Replace(s) + `"`
}
