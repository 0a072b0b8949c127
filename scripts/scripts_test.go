// Package scripts holds tests of the shell scripts next to it.
package scripts

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/gpucr/gpucr-stream/store/miniotest"
)

// TestFuzzRetryIsQuiet: fuzz.sh repeats a run that ended on the fuzzer's
// own deadline without printing that run's FAIL lines, and still prints a
// real failure in full; a target whose second run ends on the deadline
// too passes only where its corpus replays clean. A fake `go` plays the
// fuzzer.
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
		{"deadline twice, the corpus clean", "deadline deadline replayok", 0, []string{"running it again", "corpus replays clean: ok  fake"}, []string{"FAIL"}},
		{"deadline twice, the corpus fails", "deadline deadline replayfail", 1, []string{"running it again", "context deadline exceeded", "--- FAIL: FuzzX/seed#0", "fuzz: FAIL"}, nil},
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
replayok) [ "$3 $4" = '-run ^FuzzX$' ] || exit 3; echo "ok  fake 0.1s"; exit 0 ;;
replayfail) [ "$3 $4" = '-run ^FuzzX$' ] || exit 3; echo "--- FAIL: FuzzX/seed#0 (0.00s)"; echo FAIL; exit 1 ;;
esac
`
			if err := os.WriteFile(filepath.Join(bin, "go"), []byte(fake), 0o755); err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command("bash", filepath.Join(root, "scripts", "fuzz.sh"), "1s")
			cmd.Env = append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"))
			out, _ := cmd.CombinedOutput()
			checkRun(t, cmd, out, tc.code, tc.want, tc.notWant)
		})
	}
}

// checkRun checks a script's exit code and that its output holds every
// string of want and none of notWant.
func checkRun(t *testing.T, cmd *exec.Cmd, out []byte, code int, want, notWant []string) {
	t.Helper()
	if got := cmd.ProcessState.ExitCode(); got != code {
		t.Errorf("exit %d, want %d:\n%s", got, code, out)
	}
	for _, w := range want {
		if !strings.Contains(string(out), w) {
			t.Errorf("output lacks %q:\n%s", w, out)
		}
	}
	for _, w := range notWant {
		if strings.Contains(string(out), w) {
			t.Errorf("output has %q:\n%s", w, out)
		}
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
			checkRun(t, cmd, out, tc.code, tc.want, tc.notWant)
			b, _ := os.ReadFile(ran)
			if got := strings.Fields(string(b)); strings.Join(got, " ") != "deps lint unit fuzz e2e" {
				t.Errorf("ran %q, want every stage in order", got)
			}
		})
	}
}

// TestMinio: make minio's script starts MinIO on loopback with random
// credentials, prints exports that reach it (and that a second start does
// not share) and name its directory (in $TMPDIR), and a stop command that
// ends it and removes its data.
func TestMinio(t *testing.T) {
	bin, err := miniotest.Find()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true and %v", err)
		}
		t.Skipf("skipping: %v", err)
	}
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	tmp := t.TempDir()
	start := func() (env map[string]string, stop string) {
		cmd := exec.Command("bash", filepath.Join(root, "scripts", "minio.sh"))
		cmd.Env = append(os.Environ(), "MINIO_BINARY="+bin, "TMPDIR="+tmp)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("minio.sh: %v\n%s", err, out)
		}
		env = map[string]string{}
		for _, l := range strings.Split(string(out), "\n") {
			if rest, ok := strings.CutPrefix(l, "export "); ok {
				for _, kv := range strings.Fields(rest) {
					k, v, _ := strings.Cut(kv, "=")
					env[k] = v
				}
			}
			if rest, ok := strings.CutPrefix(l, "# stop it and remove its data: "); ok {
				stop = rest
			}
		}
		if stop == "" || env["AWS_ENDPOINT_URL"] == "" {
			t.Fatalf("minio.sh printed no exports or stop command:\n%s", out)
		}
		t.Cleanup(func() { exec.Command("bash", "-c", stop).Run() })
		return env, stop
	}
	env, stop := start()
	other, otherStop := start()
	if env["AWS_SECRET_ACCESS_KEY"] == other["AWS_SECRET_ACCESS_KEY"] || env["AWS_ENDPOINT_URL"] == other["AWS_ENDPOINT_URL"] {
		t.Errorf("two starts share credentials or an endpoint: %v, %v", env, other)
	}
	ctx := context.Background()
	client := func(env map[string]string, secret string) *minio.Client {
		host := strings.TrimPrefix(env["AWS_ENDPOINT_URL"], "http://")
		if !strings.HasPrefix(host, "127.0.0.1:") {
			t.Fatalf("endpoint %s is not on loopback", env["AWS_ENDPOINT_URL"])
		}
		c, err := minio.New(host, &minio.Options{Creds: credentials.NewStaticV4(env["AWS_ACCESS_KEY_ID"], secret, ""), Region: env["AWS_REGION"]})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	if err := client(env, env["AWS_SECRET_ACCESS_KEY"]).MakeBucket(ctx, "ckpt", minio.MakeBucketOptions{}); err != nil {
		t.Fatalf("with the printed credentials: %v", err)
	}
	if _, err := client(env, other["AWS_SECRET_ACCESS_KEY"]).BucketExists(ctx, "ckpt"); err == nil {
		t.Error("another start's secret is taken")
	}
	dir := strings.Fields(stop)[len(strings.Fields(stop))-1]
	if env["GPUCR_MINIO_DIR"] != dir || filepath.Dir(dir) != tmp {
		t.Errorf("GPUCR_MINIO_DIR=%s, the stop command's directory %s, TMPDIR %s", env["GPUCR_MINIO_DIR"], dir, tmp)
	}
	if out, err := exec.Command("bash", "-c", stop).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", stop, err, out)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("%s is still there after the stop command", dir)
	}
	if _, err := client(env, env["AWS_SECRET_ACCESS_KEY"]).BucketExists(ctx, "ckpt"); err == nil {
		t.Error("minio still answers after the stop command")
	}
	exec.Command("bash", "-c", otherStop).Run()
}
