package main

// Flag groups of the commands that run CRIU on a process or a container,
// CUDA processes among them.

import (
	"context"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/checkpoint"
	"github.com/gpucr/gpucr-stream/container"
	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/gpuckpt"
)

// openDriver is the CUDA driver the commands use, and findCUDAProcs how
// they find CUDA processes; tests replace them with fakes.
var (
	openDriver    = cudadriver.Open
	findCUDAProcs = cudadriver.FindCUDA
)

var (
	// containers checkpointed (checkpoint, migrate), restored (restore,
	// receive: --bundle too)
	checkpointContainerNames = []string{"container", "runtime", "runtime-root"}
	restoreContainerNames    = []string{"container", "runtime", "runtime-root", "bundle"}
	// CUDA processes suspended (checkpoint, migrate), resumed (restore;
	// receive without --stage-memory)
	suspendNames = []string{"cuda", "lock-timeout"}
	resumeNames  = []string{"cuda", "gpu-map", "stage-memory"}
)

// criuFlags are how CRIU runs, and the files it carries.
type criuFlags struct {
	path, workDir, opts, carry string
}

func (o *criuFlags) register(f *flags) {
	f.str(&o.path, "criu")
	f.str(&o.workDir, "work-dir")
	f.str(&o.opts, "criu-opts")
	f.str(&o.carry, "carry")
	f.check(func() error { return criusock.CheckCarry(o.carryList()) })
}

func (o *criuFlags) options() checkpoint.CRIU {
	return checkpoint.CRIU{Path: o.path, WorkDir: o.workDir, Args: strings.Fields(o.opts), Carry: o.carryList()}
}

// carryList is --carry.
func (o *criuFlags) carryList() []string {
	if o.carry == "" {
		return nil
	}
	return strings.Split(o.carry, ",")
}

// containerFlags name a container and its runtime, which then runs CRIU.
type containerFlags struct {
	name, runtime, root, bundle string
}

func (o *containerFlags) register(f *flags) {
	f.str(&o.name, "container")
	f.str(&o.runtime, "runtime")
	f.str(&o.root, "runtime-root")
	f.str(&o.bundle, "bundle")
}

func (o *containerFlags) options() container.Options {
	return container.Options{Runtime: o.runtime, Root: o.root, Bundle: o.bundle}
}

// target is the tree a checkpoint or migration dumps: pid, or the init of
// --container, whose runtime then runs CRIU.
func (o *containerFlags) target(ctx context.Context, cmd string, pid int, criu *checkpoint.CRIU) (int, error) {
	switch {
	case o.name != "" && pid > 0:
		return 0, usagef("%s takes --pid or --container, not both", cmd)
	case o.name == "" && pid <= 0:
		return 0, usagef("%s needs --pid PID or --container ID", cmd)
	case o.name == "":
		return pid, nil
	}
	pid, l, err := container.ForCheckpoint(ctx, o.options(), o.name)
	criu.Launcher = l
	return pid, err
}

// restoreAs makes a restore (restore, receive --restore) restore as
// --container through its runtime, where it is given.
func (o *containerFlags) restoreAs(ctx context.Context, criu *checkpoint.CRIU) error {
	if o.name == "" {
		return nil
	}
	l, err := container.ForRestore(ctx, o.options(), o.name)
	criu.Launcher = l
	return err
}

// cudaFlags are how CUDA processes are suspended and resumed.
type cudaFlags struct {
	mode, lockTimeout, gpuMap, stageMemory string
}

func (o *cudaFlags) register(f *flags) {
	f.str(&o.mode, "cuda")
	f.str(&o.lockTimeout, "lock-timeout")
	f.str(&o.gpuMap, "gpu-map")
	f.str(&o.stageMemory, "stage-memory")
}

// options are --cuda, and --lock-timeout where the command suspends
// (--stage-memory where it resumes).
func (o *cudaFlags) options(suspends bool) (gpuckpt.CUDA, error) {
	mode, err := parseCUDAMode(o.mode)
	if err != nil {
		return gpuckpt.CUDA{}, err
	}
	cuda := gpuckpt.CUDA{Mode: mode, OpenDriver: openDriver, FindProcs: findCUDAProcs}
	if suspends {
		cuda.LockTimeout, err = o.lockTimeoutDur()
	} else {
		cuda.Stage, err = o.stage()
	}
	return cuda, err
}

// stage parses --stage-memory.
func (o *cudaFlags) stage() (gpuckpt.StageMemory, error) {
	switch o.stageMemory {
	case "auto":
		return 0, nil
	case "none":
		return -1, nil
	}
	n, err := parseSize(o.stageMemory)
	if err != nil || n <= 0 {
		return 0, usagef("--stage-memory %q: want a size such as 16GiB, auto or none", o.stageMemory)
	}
	return gpuckpt.StageMemory(n), nil
}

// lockTimeoutDur parses --lock-timeout.
func (o *cudaFlags) lockTimeoutDur() (time.Duration, error) {
	d, err := time.ParseDuration(o.lockTimeout)
	if err != nil || d < 0 {
		return 0, usagef("--lock-timeout %q: want a duration such as 10s", o.lockTimeout)
	}
	return d, nil
}

func parseCUDAMode(s string) (gpuckpt.CUDAMode, error) {
	switch m := gpuckpt.CUDAMode(s); m {
	case gpuckpt.CUDAAuto, gpuckpt.CUDAOn, gpuckpt.CUDAOff:
		return m, nil
	}
	return "", usagef("--cuda %q: want auto, on or off", s)
}

// parseGPUMap reads --gpu-map: OLD_UUID=NEW_UUID[,...], or all=NEW_UUID
// for a checkpoint's one GPU, whichever it is.
func parseGPUMap(spec string) (gpuckpt.GPUMap, error) {
	if spec == "" {
		return gpuckpt.GPUMap{}, nil
	}
	if old, nw, ok := strings.Cut(spec, "="); ok && old == "all" {
		u, err := cudadriver.ParseUUID(nw)
		if err != nil {
			return gpuckpt.GPUMap{}, usagef("--gpu-map: %v", err)
		}
		return gpuckpt.GPUMap{All: true, AllTo: u}, nil
	}
	pairs, err := cudadriver.ParseGPUMap(spec)
	if err != nil {
		return gpuckpt.GPUMap{}, usagef("--gpu-map: %v", err)
	}
	return gpuckpt.GPUMap{Pairs: pairs}, nil
}

// fastPathFlags configure the GPU fast path of checkpoint, migrate and gpu
// suspend --to.
type fastPathFlags struct {
	mode, keepDir string
	files         int
}

func (o *fastPathFlags) register(f *flags) {
	f.str(&o.mode, "fast-path")
	f.num(&o.files, "vram-files")
	f.str(&o.keepDir, "vram-keep-dir")
}

func (o *fastPathFlags) options() (gpuckpt.FastPath, error) {
	mode := gpuckpt.FastPathMode(o.mode)
	if mode != gpuckpt.FastPathAuto && mode != gpuckpt.FastPathOff {
		return gpuckpt.FastPath{}, usagef("--fast-path %q: want auto or off", o.mode)
	}
	if o.files < 1 || o.files > 64 {
		return gpuckpt.FastPath{}, usagef("--vram-files %d: want 1..64", o.files)
	}
	return gpuckpt.FastPath{Mode: mode, Files: o.files, KeepDir: o.keepDir}, nil
}
