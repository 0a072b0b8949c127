package cudadriver

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/gpucr/gpucr-stream/proc"
)

// fakeProc builds a /proc-like tree: pid -> children, maps and fds.
func fakeProc(t *testing.T, kids map[int][]int, maps map[int]string, fds map[int][]string) {
	t.Helper()
	root := t.TempDir()
	mk := func(pid int) string {
		d := filepath.Join(root, strconv.Itoa(pid))
		os.MkdirAll(filepath.Join(d, "task", strconv.Itoa(pid)), 0o755)
		os.MkdirAll(filepath.Join(d, "fd"), 0o755)
		return d
	}
	all := map[int]bool{}
	for p, ks := range kids {
		all[p] = true
		for _, k := range ks {
			all[k] = true
		}
	}
	for p := range all {
		d := mk(p)
		var s string
		for _, k := range kids[p] {
			s += strconv.Itoa(k) + " "
		}
		os.WriteFile(filepath.Join(d, "task", strconv.Itoa(p), "children"), []byte(s), 0o644)
		os.WriteFile(filepath.Join(d, "maps"), []byte(maps[p]), 0o644)
		for i, target := range fds[p] {
			os.Symlink(target, filepath.Join(d, "fd", strconv.Itoa(i+3)))
		}
	}
	old := proc.Root
	proc.Root = root
	t.Cleanup(func() { proc.Root = old })
}

func TestFindCUDA(t *testing.T) {
	fakeProc(t, map[int][]int{100: {101, 102}, 101: {103}},
		map[int]string{
			101: "7f0000000000-7f0000100000 r-xp 00000000 fd:01 123 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04\n",
			103: "7f0000000000-7f0000100000 r-xp 00000000 fd:01 123 /usr/lib/libc.so.6\n",
		},
		map[int][]string{102: {"/dev/nvidiactl", "/dev/nvidia0", "/dev/null"}, 103: {"/dev/null"}})
	tree, err := proc.Tree(100)
	if err != nil {
		t.Fatal(err)
	}
	if len(tree) != 4 || tree[0] != 100 || tree[3] != 103 {
		t.Fatalf("tree %v", tree)
	}
	found, _, err := FindCUDA(100)
	if err != nil {
		t.Fatal(err)
	}
	if len(found) != 2 || found[0].PID != 101 || !found[0].MapsLibcuda || found[0].DeviceFDs != 0 ||
		found[1].PID != 102 || found[1].DeviceFDs != 2 || found[1].MapsLibcuda {
		t.Fatalf("found %+v", found)
	}
	if _, err := proc.Tree(999); err == nil {
		t.Fatal("Tree of a missing pid succeeded")
	}
}

func TestTreeRealProcess(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Skip(err)
	}
	defer cmd.Process.Kill()
	tree, err := proc.Tree(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range tree {
		if p == cmd.Process.Pid {
			if u := Inspect(p); u.IsCUDA() {
				t.Fatalf("sleep looks like CUDA: %+v", u)
			}
			return
		}
	}
	t.Fatalf("child %d not in tree %v", cmd.Process.Pid, tree)
}
