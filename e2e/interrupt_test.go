package e2e

// Interruptions: Ctrl-C in the middle of a checkpoint must leave the
// process as it was, running, with nothing of CRIU left in it.

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestCheckpointInterrupted interrupts `gpucr-stream checkpoint` of one
// target at three points (CRIU started but not yet dumping; pages
// streaming, CRIU's parasite in the process; CRIU's post-dump action
// waiting for the commit), with SIGINT to the command's process group, as
// a terminal's Ctrl-C is sent, and to gpucr-stream alone. Each time the
// command exits 130 saying it was interrupted and that the process runs
// on; the process proves itself intact, no tracer holds it, it maps no
// file it did not map before (no /memfd:CRIUMFD of CRIU's parasite), and
// no checkpoint was committed.
func TestCheckpointInterrupted(t *testing.T) {
	criu := CRIU(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	dir := ShortTempDir(t)
	tg, last := startedTarget(ctx, t, dir, 512)
	mapped := mappedNames(t, tg.PID(), tg.ChildPID())
	for _, point := range []string{"before the dump", "pages streaming", "post-dump"} {
		for _, group := range []bool{true, false} {
			name := point + map[bool]string{true: ", group", false: ", alone"}[group]
			t.Run(name, func(t *testing.T) {
				to := filepath.Join(dir, "ck-"+strings.NewReplacer(" ", "-", ",", "").Replace(name))
				marker := filepath.Join(dir, "post-dump-reached")
				os.Remove(marker)
				cmd := exec.Command(HooksBinary(t), "checkpoint", "--pid", strconv.Itoa(tg.PID()),
					"--to", to, "--criu", criu, "--no-progress")
				cmd.Env = append(os.Environ(), "GPUCR_TEST_PAUSE=post-dump:"+marker)
				var stdout, stderr bytes.Buffer
				cmd.Stdout, cmd.Stderr = &stdout, &stderr
				// Its own process group, as a shell starts a job.
				cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
				if err := cmd.Start(); err != nil {
					t.Fatal(err)
				}
				waited := make(chan error, 1)
				go func() { waited <- cmd.Wait() }()
				gcs := cmd.Process.Pid
				reached(ctx, t, waited, stderr.String, func() bool {
					switch point {
					case "before the dump":
						return criuDumping(gcs)
					case "pages streaming":
						return slices.Contains(namesMapped(tg.PID()), "/memfd:CRIUMFD") && treeBytes(to) > 1<<20
					}
					return fileExists(marker)
				})
				target := gcs
				if group {
					target = -gcs
				}
				if err := syscall.Kill(target, syscall.SIGINT); err != nil {
					t.Fatal(err)
				}
				select {
				case <-waited:
				case <-ctx.Done():
					cmd.Process.Kill()
					t.Fatalf("checkpoint did not end after SIGINT\nstderr: %s", stderr.String())
				}
				t.Logf("stderr:\n%s", stderr.String())
				if code := cmd.ProcessState.ExitCode(); code != 130 {
					t.Errorf("exit %d after SIGINT, want 130", code)
				}
				says := fmt.Sprintf("process %d runs on, with no CRIU mapping left in it", tg.PID())
				if !strings.Contains(stderr.String(), "interrupted by SIGINT") || !strings.Contains(stderr.String(), says) {
					t.Errorf("the error does not say it was interrupted and %q:\n%s", says, stderr.String())
				}
				for _, noise := range []string{"context canceled", "use of closed", "signal: killed", "signal: interrupt"} {
					if strings.Contains(stderr.String(), noise) {
						t.Errorf("the error says %q:\n%s", noise, stderr.String())
					}
				}
				for _, pid := range []int{tg.PID(), tg.ChildPID()} {
					if tracer := tracerOf(pid); tracer != 0 {
						t.Errorf("process %d is still traced by %d", pid, tracer)
					}
				}
				if now := mappedNames(t, tg.PID(), tg.ChildPID()); !subset(now, mapped) {
					t.Errorf("after the interrupt the target maps %q; before it mapped %q", now, mapped)
				}
				if fileExists(filepath.Join(to, "manifest.json")) {
					t.Error("an interrupted checkpoint committed a manifest")
				} else if fileExists(to) {
					t.Errorf("the interrupted checkpoint left %s, which it made", to)
				}
				tg.ProveIntact(ctx, t, &last)
			})
		}
	}
}

// reached waits until cond holds, polling; the command ending first, or
// ctx, fails the test.
func reached(ctx context.Context, t *testing.T, waited chan error, stderr func() string, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case err := <-waited:
			waited <- err
			t.Fatalf("checkpoint ended (%v) before the point it was to be interrupted at\nstderr: %s", err, stderr())
		case <-ctx.Done():
			t.Fatalf("the point was never reached: %v", ctx.Err())
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// criuDumping says a child of pid runs `criu dump`.
func criuDumping(pid int) bool {
	files, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	for _, f := range files {
		b, _ := os.ReadFile(f)
		for _, c := range strings.Fields(string(b)) {
			if cl, err := os.ReadFile("/proc/" + c + "/cmdline"); err == nil && bytes.Contains(cl, []byte("\x00dump\x00")) {
				return true
			}
		}
	}
	return false
}

// namesMapped lists the files pid maps, as /proc/PID/maps names them
// (without " (deleted)").
func namesMapped(pid int) []string {
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if i := strings.IndexByte(sc.Text(), '/'); i >= 0 {
			n := strings.TrimSuffix(sc.Text()[i:], " (deleted)")
			if !slices.Contains(out, n) {
				out = append(out, n)
			}
		}
	}
	return out
}

// mappedNames is namesMapped of each of pids, each name prefixed with its
// process's place in pids.
func mappedNames(t *testing.T, pids ...int) []string {
	t.Helper()
	var out []string
	for i, p := range pids {
		names := namesMapped(p)
		if len(names) == 0 {
			t.Fatalf("process %d maps nothing (gone?)", p)
		}
		for _, n := range names {
			out = append(out, fmt.Sprintf("%d:%s", i, n))
		}
	}
	return out
}

func subset(a, b []string) bool {
	for _, x := range a {
		if !slices.Contains(b, x) {
			return false
		}
	}
	return true
}

// tracerOf is TracerPid of /proc/PID/status.
func tracerOf(pid int) int {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "TracerPid:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}

// treeBytes is the size of the files under dir (temporary ones included).
func treeBytes(dir string) int64 {
	var n int64
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			if info, err := d.Info(); err == nil {
				n += info.Size()
			}
		}
		return nil
	})
	return n
}
