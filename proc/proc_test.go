package proc

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/testwait"
)

func TestTreeAndWaitGone(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	tree, err := Tree(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, p := range tree {
		found = found || p == cmd.Process.Pid
	}
	if !found || tree[0] != os.Getpid() {
		t.Fatalf("child %d not in tree %v", cmd.Process.Pid, tree)
	}
	ctx := context.Background()
	if err := WaitGone(ctx, []int{cmd.Process.Pid}, false, 50*time.Millisecond); err == nil {
		t.Fatal("WaitGone returned for a live process")
	}
	cmd.Process.Kill()
	// Killed but not reaped: a zombie is gone for !reaped, present for reaped.
	if err := WaitGone(ctx, []int{cmd.Process.Pid}, false, 5*time.Second); err != nil {
		t.Fatalf("zombie not seen as dead: %v", err)
	}
	if err := WaitGone(ctx, []int{cmd.Process.Pid}, true, 50*time.Millisecond); err == nil {
		t.Fatal("WaitGone(reaped) returned for an unreaped zombie")
	}
	if d := Dead([]int{os.Getpid(), cmd.Process.Pid}); len(d) != 1 || d[0] != cmd.Process.Pid {
		t.Fatalf("Dead = %v, want only the zombie %d", d, cmd.Process.Pid)
	}
	cmd.Wait()
	if d := Dead([]int{cmd.Process.Pid}); len(d) != 0 {
		t.Fatalf("Dead = %v after the reap", d)
	}
	if err := WaitGone(ctx, []int{cmd.Process.Pid}, true, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if Exists(cmd.Process.Pid) {
		t.Fatal("Exists after reap")
	}
	if _, err := Tree(cmd.Process.Pid); err == nil {
		t.Fatal("Tree of a reaped pid succeeded")
	}
}

func TestSpaceAndMemory(t *testing.T) {
	if s := Space(); s == "/" || s != Space() {
		t.Fatalf("Space() = %q, then %q", s, Space())
	}
	if AvailableMemory() <= 0 {
		t.Fatal("no MemAvailable")
	}
}

// TestDumpEstimate: this process's anonymous memory grows by what it
// allocates and touches.
func TestDumpEstimate(t *testing.T) {
	self := []int{os.Getpid()}
	before := DumpEstimate(self)
	buf := make([]byte, 64<<20)
	for i := range buf {
		if i%4096 == 0 {
			buf[i] = 1
		}
	}
	after := DumpEstimate(self)
	if before <= 0 || after-before < 48<<20 {
		t.Errorf("estimate %d -> %d after touching 64 MiB", before, after)
	}
	runtime.KeepAlive(buf)
	if got := DumpEstimate([]int{-1}); got != 0 {
		t.Errorf("estimate of no process: %d", got)
	}
}

// TestKillTree kills a process and its child.
func TestKillTree(t *testing.T) {
	cmd := exec.Command("sh", "-c", "sleep 30 & wait")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	var tree []int
	for end := time.Now().Add(testwait.Scale(5 * time.Second)); len(tree) < 2 && time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		tree, _ = Tree(cmd.Process.Pid)
	}
	if len(tree) < 2 {
		t.Fatalf("the shell's child never showed: %v", tree)
	}
	if err := KillTree(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	if err := WaitGone(context.Background(), tree[1:], false, 5*time.Second); err != nil {
		t.Fatalf("the child outlived KillTree: %v", err)
	}
}

func TestLargestDeletedFile(t *testing.T) {
	self := []int{os.Getpid()}
	before, _ := LargestDeletedFile(self)
	f, err := os.CreateTemp(t.TempDir(), "ghost")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	want := before + 3<<20 + 5
	if err := f.Truncate(want); err != nil {
		t.Fatal(err)
	}
	if n, _ := LargestDeletedFile(self); n == want {
		t.Fatalf("a file not unlinked counted: %d", n)
	}
	os.Remove(f.Name())
	if n, p := LargestDeletedFile(self); n != want || !strings.Contains(p, "ghost") {
		t.Fatalf("largest deleted file: %d %q, want %d bytes of %s", n, p, want, f.Name())
	}
	// Shared anonymous memory is memory to CRIU, not a ghost file.
	m, err := unix.Mmap(-1, 0, int(want)+4<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	if n, p := LargestDeletedFile(self); n != want {
		t.Fatalf("with a shared anonymous mapping: %d %q, want the file's %d", n, p, want)
	}
}

// TestHolder: a process by its command line, a thread by its process, a
// free PID by nothing.
func TestHolder(t *testing.T) {
	pid := os.Getpid()
	if h := Holder(pid); !strings.HasPrefix(h, fmt.Sprintf("process %d %q", pid, strings.Join(os.Args, " "))) {
		t.Errorf("Holder(self) = %q", h)
	}
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	for _, e := range tasks {
		if tid, _ := strconv.Atoi(e.Name()); tid != pid {
			if h := Holder(tid); !strings.HasPrefix(h, fmt.Sprintf("thread %d of process %d ", tid, pid)) {
				t.Errorf("Holder(thread) = %q", h)
			}
			break
		}
	}
	if h := Holder(1 << 30); h != "" {
		t.Errorf("Holder(free) = %q", h)
	}
}

// TestStartTime: field 22 and the state of /proc/PID/stat, whatever the
// command holds; nothing for a process that is gone or a stat cut short.
func TestStartTime(t *testing.T) {
	root := t.TempDir()
	defer func(r string) { Root = r }(Root)
	Root = root
	tail := " 1 1 1 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 %s 1000 10 18446744073709551615"
	for _, c := range []struct {
		pid   int
		stat  string // "": no stat file
		start uint64
		state byte
	}{
		{10, "10 (target) S" + fmt.Sprintf(tail, "123456"), 123456, 'S'},
		{11, "11 (a ) R (b) Z" + fmt.Sprintf(tail, "77"), 77, 'Z'},
		{12, "12 (short) S 1 1", 0, 0},
		{13, "13 (bad) S" + fmt.Sprintf(tail, "x"), 0, 0},
		{14, "", 0, 0},
	} {
		if c.stat != "" {
			dir := filepath.Join(root, strconv.Itoa(c.pid))
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "stat"), []byte(c.stat+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if start, state := StartTime(c.pid); start != c.start || state != c.state {
			t.Errorf("pid %d: StartTime = %d, %q; want %d, %q", c.pid, start, state, c.start, c.state)
		}
	}
}
