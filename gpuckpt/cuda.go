package gpuckpt

// The CUDA policy around CRIU: which processes of the tree hold GPU state
// (Find) and on which GPUs, before a dump; their suspend and its undo are
// suspend.go's. After a restore the restored processes are resumed, onto
// other GPUs where a GPUMap says so.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/proc"
	"github.com/gpucr/gpucr-stream/scratch"
	"github.com/gpucr/gpucr-stream/vram"
)

// CUDAMode says what to do with the CUDA processes of a tree.
type CUDAMode string

const (
	// CUDAAuto suspends and resumes the CUDA processes found.
	CUDAAuto CUDAMode = "auto"
	// CUDAOn requires CUDA processes.
	CUDAOn CUDAMode = "on"
	// CUDAOff runs plain CRIU.
	CUDAOff CUDAMode = "off"
)

// CUDA is the GPU side of a checkpoint or restore.
type CUDA struct {
	Mode CUDAMode // "" is CUDAAuto
	// LockTimeout is how long the lock may wait for GPU work in flight
	// (0: the driver's default).
	LockTimeout time.Duration
	// Stage is the memory a restore may read VRAM files ahead into while
	// CRIU restores (stage.go).
	Stage StageMemory
	// OpenDriver and FindProcs default to cudadriver.Open and cudadriver.FindCUDA;
	// tests hand in fakes.
	OpenDriver func() (cudadriver.Driver, error)
	FindProcs  func(root int) ([]cudadriver.Usage, []int, error)
	// HostGPUs defaults to cudadriver.HostGPUs (the GPUs a --gpu-map may name).
	HostGPUs func(ctx context.Context) ([]cudadriver.HostGPU, error)
}

// EffectiveMode is c.Mode, with "" read as CUDAAuto.
func (c CUDA) EffectiveMode() CUDAMode {
	if c.Mode == "" {
		return CUDAAuto
	}
	return c.Mode
}

// Warm loads the driver and initialises it in this process (cuInit), so
// that a restore's first driver step does not wait for that: a restore
// runs it beside CRIU's. Errors are left to the steps that need the
// driver.
func (c CUDA) Warm() {
	if c.EffectiveMode() == CUDAOff {
		return
	}
	if d, err := c.open(); err == nil {
		if w, ok := d.(interface{ Init() error }); ok {
			_ = w.Init()
		}
	}
}

func (c CUDA) open() (cudadriver.Driver, error) {
	if c.OpenDriver != nil {
		return c.OpenDriver()
	}
	return cudadriver.Open()
}

func (c CUDA) find(root int) ([]cudadriver.Usage, []int, error) {
	if c.FindProcs != nil {
		return c.FindProcs(root)
	}
	return cudadriver.FindCUDA(root)
}

// Checkpoint is the GPU side of one checkpoint: the CUDA processes of
// the tree and their suspension.
type Checkpoint struct {
	drv  cudadriver.Driver
	pids []int
	gpus []cudadriver.GPUInfo
	// query is closed once gpus holds nvidia-smi's answer (StartGPUQuery
	// asks once).
	query chan struct{}
	// undo is the stack of the suspend's steps (suspend.go); driver,
	// the driver's steps, once Suspend ran.
	undo   undoStack
	driver *driverSuspend
	// fast: the device memory the fast path moved out (nil: the driver
	// takes it all), its steps timed in fastT; keepDir holds its copy
	// until the commit (vramfiles.go).
	fast    *vram.FastSuspension
	fastT   fastTimings
	keepDir *scratch.Dir
	// earlier: a --dedup checkpoint's earlier ones (earlier.go).
	earlier *earliers
	// driverVersion is the CUDA version of the driver ("13.0").
	driverVersion string
}

// Find decides, per c.Mode, which processes of root's tree have GPU
// state to suspend. nil without any (or with CUDAOff).
func Find(c CUDA, root int) (*Checkpoint, error) {
	if c.EffectiveMode() == CUDAOff {
		return nil, nil
	}
	found, _, err := c.find(root)
	if err != nil {
		return nil, err
	}
	if len(found) == 0 && c.EffectiveMode() == CUDAAuto {
		return nil, nil
	}
	drv, err := c.open()
	if err != nil {
		if len(found) > 0 {
			return nil, fmt.Errorf("processes %v of the tree use CUDA, but the driver cannot be used: %w (--cuda off dumps without the GPU step, which CRIU refuses for a process holding the GPU)", cudadriver.PIDs(found), err)
		}
		return nil, fmt.Errorf("--cuda on: %w", err)
	}
	cc := &Checkpoint{drv: drv}
	if v, err := drv.Version(); err == nil {
		cc.driverVersion = cudadriver.VersionString(v)
	}
	for _, u := range found {
		if u.DeviceFDs == 0 {
			// libcuda loaded but no GPU open: either never initialised
			// (nothing to do) or already checkpointed (Suspend leaves it).
			if _, err := drv.State(u.PID); err != nil {
				continue
			}
		}
		cc.pids = append(cc.pids, u.PID)
	}
	if len(cc.pids) == 0 {
		if c.EffectiveMode() == CUDAOn {
			return nil, fmt.Errorf("--cuda on: no CUDA process in the tree of %d", root)
		}
		return nil, nil
	}
	return cc, nil
}

// manifestGPUs turns what nvidia-smi said into manifest records.
func (cc *Checkpoint) manifestGPUs() []manifest.GPU {
	if cc == nil {
		return nil
	}
	var out []manifest.GPU
	for _, g := range cc.gpus {
		d := g.Driver
		if cc.driverVersion != "" {
			if d != "" {
				d += " (CUDA " + cc.driverVersion + ")"
			} else {
				d = "CUDA " + cc.driverVersion
			}
		}
		out = append(out, manifest.GPU{UUID: g.UUID, Name: g.Name, Driver: d, PID: g.PID, Bytes: g.Bytes})
	}
	if len(out) == 0 {
		for _, pid := range cc.pids {
			out = append(out, manifest.GPU{Driver: "CUDA " + cc.driverVersion, PID: pid})
		}
	}
	return out
}

// QueryGPUs records the GPUs of cc's processes in meta, and the time it
// waited for nvidia-smi's answer. A nil cc (no CUDA process) does nothing.
func (cc *Checkpoint) QueryGPUs(ctx context.Context, meta *manifest.Manifest) []Phase {
	if cc == nil {
		return nil
	}
	q := time.Now()
	cc.GPUs(ctx)
	meta.GPUs = cc.manifestGPUs()
	return []Phase{{"gpu query (nvidia-smi)", time.Since(q).Seconds()}}
}

// StartGPUQuery asks nvidia-smi, in the background, which GPUs cc's
// processes use and the memory each holds there: it takes 0.04-0.06 s,
// which a checkpoint spends on its checks and the opening of its
// destination meanwhile. The answer must come while the processes still
// hold their device memory (GPUs waits for it, and is what waits for the
// query's goroutine). A second call does nothing.
func (cc *Checkpoint) StartGPUQuery(ctx context.Context) {
	if cc == nil || cc.query != nil {
		return
	}
	done := make(chan struct{})
	cc.query = done
	go func() {
		defer close(done)
		cc.gpus, _ = cudadriver.GPUs(ctx, cc.pids)
	}()
}

// GPUs is which GPUs cc's processes use and the memory each holds there,
// asked of nvidia-smi once (StartGPUQuery, unless begun before; a
// migration asks before it opens its local copy, the dump again later);
// nil-safe, nil when it cannot tell.
func (cc *Checkpoint) GPUs(ctx context.Context) []cudadriver.GPUInfo {
	if cc == nil {
		return nil
	}
	cc.StartGPUQuery(ctx)
	<-cc.query
	return cc.gpus
}

// PIDs are the suspended CUDA processes (nil without any).
func (cc *Checkpoint) PIDs() []int {
	if cc == nil {
		return nil
	}
	return cc.pids
}

// Restore finds the CUDA processes of a restored tree and brings them
// back onto the GPU. It returns the pids it resumed.
func Restore(ctx context.Context, c CUDA, root int, pairs []cudadriver.GPUPair) ([]int, DriverTimings, error) {
	var t DriverTimings
	if c.EffectiveMode() == CUDAOff {
		return nil, t, nil
	}
	found, _, err := c.find(root)
	if err != nil {
		return nil, t, err
	}
	if len(found) == 0 {
		if c.EffectiveMode() == CUDAOn {
			return nil, t, fmt.Errorf("--cuda on: no CUDA process in the restored tree of %d", root)
		}
		return nil, t, nil
	}
	drv, err := c.open()
	if err != nil {
		return nil, t, fmt.Errorf("restored processes %v use CUDA, but the driver cannot be used: %w; they stay suspended (checkpointed) until `gpucr-stream gpu resume --pid PID` succeeds", cudadriver.PIDs(found), err)
	}
	var pids []int
	for _, u := range found {
		if _, err := drv.State(u.PID); err == nil {
			pids = append(pids, u.PID)
		} else if u.DeviceFDs > 0 {
			return nil, t, err
		}
	}
	resumed, t, err := resumeRestored(drv, pids, pairs)
	if err != nil && len(pairs) > 0 && errors.Is(err, cudadriver.ErrUnsupported) {
		// Driver 580 on two H100s refused (CUDA_ERROR_INVALID_VALUE) a
		// map that named only the GPU the process used (GPU0=GPU1) and
		// took the same move as the permutation GPU0=GPU1,GPU1=GPU0: it
		// wants every GPU the process sees mapped. Complete the map with
		// this host's GPUs and ask once more; the refused processes are
		// still checkpointed, the others only wait for their unlock.
		if host, herr := c.hostUUIDs(ctx); herr == nil {
			if full := completePairs(pairs, host); len(full) > len(pairs) {
				var t2 DriverTimings
				resumed, t2, err = resumeRestored(drv, pids, full)
				t.Restore += t2.Restore
				t.Unlock += t2.Unlock
				if err != nil {
					err = fmt.Errorf("%w (also with the map completed to every GPU of this host: %s)", err, cudadriver.FormatGPUMap(full))
				}
			}
		}
	}
	if err != nil {
		return resumed, t, fmt.Errorf("%w; the restored process stays suspended: retry with `gpucr-stream gpu resume --pid PID`", err)
	}
	if c.EffectiveMode() == CUDAOn && len(resumed) == 0 {
		return nil, t, fmt.Errorf("--cuda on: no restored process was checkpointed on the GPU")
	}
	return resumed, t, nil
}

// GPUMap moves GPU state to other GPUs on restore: explicit pairs, or the
// checkpoint's one GPU, whichever it is, to AllTo.
type GPUMap struct {
	Pairs []cudadriver.GPUPair
	All   bool
	AllTo cudadriver.UUID
}

// For resolves m against the GPUs a checkpoint records. A map that does
// not fit them is an error wrapping errdefs.ErrUsage.
func (m GPUMap) For(gpus []manifest.GPU) ([]cudadriver.GPUPair, error) {
	if !m.All {
		return m.Pairs, nil
	}
	uuids := map[string]bool{}
	for _, g := range gpus {
		if g.UUID != "" {
			uuids[g.UUID] = true
		}
	}
	if len(uuids) != 1 {
		return nil, errdefs.Usagef("--gpu-map all=%s: the checkpoint records %d GPUs; name each OLD_UUID", m.AllTo, len(uuids))
	}
	var pairs []cudadriver.GPUPair
	for u := range uuids {
		old, err := cudadriver.ParseUUID(u)
		if err != nil {
			return nil, errdefs.Usagef("--gpu-map: %v", err)
		}
		pairs = append(pairs, cudadriver.GPUPair{Old: old, New: m.AllTo})
	}
	return pairs, nil
}

// CheckMap refuses, before CRIU runs, a map the driver's restore would
// fail on later, leaving a restored process stuck in the checkpointed
// state: a new GPU this host lacks, or one with less free memory than the
// checkpoint recorded for the GPUs mapped onto it. recorded nil checks the
// GPUs only (a receiver before any sender). Without nvidia-smi nothing
// is checked: the driver's restore decides.
func (c CUDA) CheckMap(ctx context.Context, pairs []cudadriver.GPUPair, recorded []manifest.GPU) error {
	if len(pairs) == 0 || c.EffectiveMode() == CUDAOff {
		return nil
	}
	host, err := c.hostGPUs(ctx)
	if err != nil {
		return nil
	}
	free := map[cudadriver.UUID]int64{}
	var names []string
	for _, g := range host {
		free[g.UUID] = g.Free
		names = append(names, g.UUID.String())
	}
	need := map[cudadriver.UUID]int64{}
	for _, p := range pairs {
		if _, ok := free[p.New]; !ok {
			return errdefs.Usagef("--gpu-map: GPU %s is not on this host (its GPUs: %s)", p.New, strings.Join(names, ", "))
		}
		for _, g := range recorded {
			if u, err := cudadriver.ParseUUID(g.UUID); err == nil && u == p.Old {
				need[p.New] += g.Bytes
			}
		}
	}
	for _, p := range pairs {
		if n := need[p.New]; n > free[p.New] {
			return errdefs.Usagef("--gpu-map %s=%s: GPU %s has %d MiB free, the checkpoint's memory mapped onto it needs %d MiB", p.Old, p.New, p.New, free[p.New]>>20, n>>20)
		}
	}
	return nil
}

// hostGPUs lists this host's GPUs (c.HostGPUs, else nvidia-smi).
func (c CUDA) hostGPUs(ctx context.Context) ([]cudadriver.HostGPU, error) {
	if c.HostGPUs != nil {
		return c.HostGPUs(ctx)
	}
	return cudadriver.HostGPUs(ctx)
}

// hostUUIDs lists this host's GPUs by UUID.
func (c CUDA) hostUUIDs(ctx context.Context) ([]cudadriver.UUID, error) {
	gpus, err := c.hostGPUs(ctx)
	var out []cudadriver.UUID
	for _, g := range gpus {
		out = append(out, g.UUID)
	}
	return out, err
}

// completePairs extends pairs to a permutation of host: every GPU of the
// host that the map does not move stays where it is if it can, and the
// rest take the GPUs the map freed, in the host's order (GPU0=GPU1 on two
// GPUs becomes GPU0=GPU1,GPU1=GPU0).
func completePairs(pairs []cudadriver.GPUPair, host []cudadriver.UUID) []cudadriver.GPUPair {
	olds, news := map[cudadriver.UUID]bool{}, map[cudadriver.UUID]bool{}
	for _, p := range pairs {
		olds[p.Old], news[p.New] = true, true
	}
	out := append([]cudadriver.GPUPair(nil), pairs...)
	var fromFree, toFree []cudadriver.UUID
	for _, g := range host {
		if !olds[g] && !news[g] {
			out = append(out, cudadriver.GPUPair{Old: g, New: g})
			continue
		}
		if !olds[g] {
			fromFree = append(fromFree, g)
		}
		if !news[g] {
			toFree = append(toFree, g)
		}
	}
	for i := 0; i < len(fromFree) && i < len(toFree); i++ {
		out = append(out, cudadriver.GPUPair{Old: fromFree[i], New: toFree[i]})
	}
	return out
}

// targets are m's new GPUs as pairs (Old is zero for all=NEW), for
// CheckMap before the checkpoint's GPUs are known.
func (m GPUMap) Targets() []cudadriver.GPUPair {
	if m.All {
		return []cudadriver.GPUPair{{New: m.AllTo}}
	}
	return m.Pairs
}

// CheckDumpable refuses, before any GPU step, a CUDA tree whose GPU step
// the driver could not undo (CheckUndoable: NCCL ranks, shared device
// memory), and one that CRIU would refuse to dump after that step: one
// holding established TCP connections without --tcp-established (or
// --tcp-close) in criuArgs. Undoing the driver's checkpoint is not always
// possible (driver 580 refused it for an NCCL pair, leaving both processes
// frozen), so the refusal must come first. tree is the whole process tree.
func (cc *Checkpoint) CheckDumpable(ctx context.Context, tree []int, criuArgs []string, f FastPath) error {
	if cc == nil || len(cc.pids) == 0 {
		return nil
	}
	if err := CheckUndoable(ctx, cc.pids, f.Mode != FastPathOff); err != nil {
		return err
	}
	if slices.ContainsFunc(criuArgs, func(a string) bool { return a == "--tcp-established" || a == "--tcp-close" }) {
		return nil
	}
	conns := proc.EstablishedTCP(tree)
	if len(conns) == 0 {
		return nil
	}
	list := make([]string, 0, 3)
	for i, c := range conns {
		if i == 3 {
			list = append(list, fmt.Sprintf("and %d more", len(conns)-3))
			break
		}
		list = append(list, c.String())
	}
	return errdefs.Usagef("the tree holds established TCP connections (%s), which CRIU dumps only with --criu-opts --tcp-established; refused before the GPU step, which the driver may not be able to undo", strings.Join(list, ", "))
}
