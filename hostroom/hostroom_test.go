package hostroom

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/proc"
)

// fakeHost lays out a /proc (pid 42's cgroup file, this process's
// mountinfo) and cgroup files under a temporary directory, and points
// proc.Root at it.
func fakeHost(t *testing.T, cgroup, mountinfo string, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	all := map[string]string{"proc/42/cgroup": cgroup, "proc/self/mountinfo": strings.ReplaceAll(mountinfo, "ROOT", root)}
	for k, v := range files {
		all[k] = v
	}
	for name, body := range all {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	old := proc.Root
	proc.Root = filepath.Join(root, "proc")
	t.Cleanup(func() { proc.Root = old })
	return root
}

func TestCgroups(t *testing.T) {
	const v2mount = "30 25 0:26 / ROOT/cg2 rw,nosuid - cgroup2 cgroup2 rw\n"
	const v1mount = "35 31 0:32 / ROOT/cg1/memory rw,relatime - cgroup cgroup rw,memory\n41 31 0:38 / ROOT/unified rw - cgroup2 cgroup2 rw\n"
	for _, tc := range []struct {
		name, cgroup, mountinfo string
		files                   map[string]string
		want                    []Cgroup // paths relative to the root
		headroom                int64    // of the innermost
	}{
		{"v2, a limit above", "0::/jobs/gpu\n", v2mount, map[string]string{
			"cg2/cgroup.controllers":      "cpu io memory pids\n",
			"cg2/jobs/gpu/memory.max":     "max\n",
			"cg2/jobs/gpu/memory.current": "1000\n",
			"cg2/jobs/gpu/memory.stat":    "anon 900\ninactive_file 100\n",
			"cg2/jobs/memory.max":         "5000\n",
			"cg2/jobs/memory.current":     "3000\n",
			"cg2/jobs/memory.stat":        "inactive_file 500\n",
		}, []Cgroup{{Path: "cg2/jobs/gpu", Used: 900}, {Path: "cg2/jobs", Limit: 5000, Used: 2500}, {Path: "cg2"}}, -1},
		{"v2 without the memory controller: v1", "4:memory:/job\n0::/\n", v1mount, map[string]string{
			"unified/cgroup.controllers":           "hugetlb\n",
			"cg1/memory/job/memory.limit_in_bytes": "4096\n",
			"cg1/memory/job/memory.usage_in_bytes": "8192\n",
			"cg1/memory/memory.limit_in_bytes":     "9223372036854771712\n",
			"cg1/memory/memory.usage_in_bytes":     "100\n",
		}, []Cgroup{{Path: "cg1/memory/job", V1: true, Limit: 4096, Used: 8192}, {Path: "cg1/memory", V1: true, Used: 100}}, 0},
		{"no memory controller", "0::/\n", v2mount, map[string]string{"cg2/cgroup.controllers": "cpu\n"}, nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := fakeHost(t, tc.cgroup, tc.mountinfo, tc.files)
			got, err := Cgroups(42)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(tc.want) {
				t.Fatalf("%+v, want %+v", got, tc.want)
			}
			for i, c := range got {
				w := tc.want[i]
				w.Path = filepath.Join(root, w.Path)
				if c != w {
					t.Fatalf("cgroup %d: %+v, want %+v", i, c, w)
				}
			}
			if len(got) > 0 && got[0].Headroom() != tc.headroom {
				t.Fatalf("headroom %d, want %d", got[0].Headroom(), tc.headroom)
			}
		})
	}
	fakeHost(t, "0::/gone\n", v2mount, map[string]string{"cg2/cgroup.controllers": "memory\n"})
	if _, err := Cgroups(42); err == nil {
		t.Fatal("a cgroup directory that is not there: no error")
	}
}

func TestFSOf(t *testing.T) {
	d, err := os.Open("/dev/shm")
	if err != nil {
		t.Skip("no /dev/shm")
	}
	defer d.Close()
	fs, err := FSOf(d)
	if err != nil || !fs.Memory || fs.Free <= 0 {
		t.Fatalf("/dev/shm: %+v %v, want a file system in memory with room", fs, err)
	}
}
