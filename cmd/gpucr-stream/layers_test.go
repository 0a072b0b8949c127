package main

import (
	"os/exec"
	"strings"
	"testing"
)

// rooms ranks the packages (docs/DEVELOPING.md, Layout): a package imports only
// packages of a lower rank, so that dependencies flow one way.
var rooms = map[string]int{
	"errdefs": 0, "redact": 0, "knobs": 0, "testwait": 0, "transport/tcp/wire": 0, "store/miniotest": 0, "bufpool": 0,
	"scripts": 0, "scripts/testsum": 0, // tooling: tests of the scripts, make e2e's reporter
	"testhook": 1, "codec": 1, "manifest": 1, "store": 1, "proc": 1, "fsat": 1, "tcpwait": 1,
	"crypt": 2, "scratch": 2, "hostroom": 2, "hostroom/cgrouptest": 0, "store/dir": 2, "store/mem": 2, "store/storetest": 2,
	"cudadriver": 2, "preloadctl": 2, "fdgraft": 2,
	"pipeline": 3, "store/s3": 3, "chunkstore": 3, "vram": 3, "vram/vramtest": 3, "cudadriver/drivertest": 3,
	"streamer": 4, "source": 4, "pipeline/pipelinetest": 4,
	"criusock": 5, "transport/tcp": 5, "cisformat": 5, "cisformat/cisformattest": 0, "ctrtar": 5,
	"location": 6, "catalog": 6, "swrk": 6,
	"gpuckpt": 7, "container": 7,
	"checkpoint":       8,
	"cmd/gpucr-stream": 9, "cmd/gpucr-stream-swrk": 9,
}

func TestDependenciesFlowOneWay(t *testing.T) {
	const mod = "github.com/gpucr/gpucr-stream/"
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("go is needed to list the packages: %v", err)
	}
	out, err := exec.Command(goBin, "list", "-f", `{{.ImportPath}} {{join .Imports " "}}`, mod+"...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		pkg, ok := strings.CutPrefix(f[0], mod)
		if !ok || strings.HasPrefix(pkg, "e2e") {
			continue
		}
		rank, known := rooms[pkg]
		if !known {
			t.Errorf("package %s has no rank in rooms: place it in the layout", pkg)
			continue
		}
		for _, imp := range f[1:] {
			dep, ours := strings.CutPrefix(imp, mod)
			if ours && rooms[dep] >= rank {
				t.Errorf("%s (rank %d) imports %s (rank %d): dependencies must flow down", pkg, rank, dep, rooms[dep])
			}
		}
	}
}
