package main

import (
	"context"
	"fmt"

	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/gpuckpt"
	"github.com/gpucr/gpucr-stream/preloadctl"
)

var gpuCommand = command{"gpu", "CUDA checkpoint steps of --pid: gpu info|state|lock|checkpoint|restore|unlock|suspend|resume (suspend --to DEST / resume --from SRC: the fast path, the process alive without device memory); gpu hash: how long finding changed device memory takes, hashed on the device and copied out and hashed on the host; gpu fill: a restore's filler, which a restore starts itself (its socket on descriptor 3)", "ACTION",
	func() options { return &gpuOptions{} }}

type gpuOptions struct {
	loc       locationFlags
	cuda      cudaFlags
	fast      fastPathFlags
	to, from  string
	pid       int
	hostCheck bool
}

func (o *gpuOptions) register(f *flags) {
	f.show(reportNames...)
	o.loc.register(f.narrow(keyNames, encodeNames, s3WriteNames))
	o.cuda.register(f.narrow([]string{"lock-timeout", "gpu-map", "stage-memory"}))
	o.fast.register(f)
	f.str(&o.to, "to")
	f.str(&o.from, "from")
	f.num(&o.pid, "pid")
	f.boolean(&o.hostCheck, "host-check")
	f.describe("pid", "the process whose CUDA state the step takes, with its tree's CUDA processes")
	f.describe("to", "suspend: take the fast path, the device memory into this checkpoint: a path or file:///path (archive directory) or s3://BUCKET/PREFIX/NAME (-: the driver's suspend alone)")
	f.describe("from", "resume: the checkpoint of suspend --to to take the device memory back from: an archive directory or s3://BUCKET/PREFIX/NAME (-: the driver's resume alone)")
	f.describe("lock-timeout", "lock, suspend: how long the CUDA lock may wait for GPU work in flight (0: the driver's default)")
	f.describe("gpu-map", "restore, resume: move GPU state from OLD to NEW GPU: OLD_UUID=NEW_UUID[,...]")
	f.describe("stage-memory", "resume --from: memory to read the VRAM files into while the driver restores, so that the copy in reads memory: a size, auto (half the available memory) or none (read them from the checkpoint during the copy in)")
	f.describe("key-file", "suspend --to, resume --from: encryption key file (mode 0600; make one with: gpucr-stream keygen > FILE), else $GPUCR_KEY")
}

// run is `gpucr-stream gpu ACTION --pid PID`: the driver's checkpoint
// steps one at a time (gpuckpt.GPUStep). Actions: info, state, lock,
// checkpoint, restore, unlock, suspend, resume; suspend --to DEST and
// resume --from SRC take the fast path; hash measures the ways of finding
// changed device memory (vram.HashDevice).
func (o *gpuOptions) run(ctx context.Context, c *cli, args []string) error {
	if len(args) != 1 {
		return usagef("gpu needs one action: info, state, lock, checkpoint, restore, unlock, suspend, resume, hash")
	}
	action := args[0]
	if action == "fill" {
		// Before the driver is loaded here: the library binds it itself.
		lib, err := preloadctl.FindLibrary()
		if err != nil {
			return err
		}
		return preloadctl.RunFiller(3, lib, cudadriver.DriverLibrary())
	}
	drv, err := openDriver()
	if err != nil {
		return err
	}
	if action == "info" {
		info := gpuckpt.GPUInfo(ctx, drv)
		if c.json {
			return c.printJSON(info)
		}
		fmt.Fprintf(c.stdout, "CUDA driver %s (%s), process checkpoint API present\n", info.CUDAVersion, info.Library)
		for _, g := range info.GPUs {
			fmt.Fprintf(c.stdout, "  %s %s driver %s\n", g.UUID, g.Name, g.Driver)
		}
		return nil
	}
	if o.pid <= 0 {
		return usagef("gpu %s needs --pid PID", action)
	}
	timeout, err := o.cuda.lockTimeoutDur()
	if err != nil {
		return err
	}
	var pairs []cudadriver.GPUPair
	if o.cuda.gpuMap != "" {
		if pairs, err = cudadriver.ParseGPUMap(o.cuda.gpuMap); err != nil {
			return usagef("--gpu-map: %v", err)
		}
	}
	to, err := parseLoc("--to", o.to)
	if err != nil {
		return err
	}
	from, err := parseLoc("--from", o.from)
	if err != nil {
		return err
	}
	fast, err := o.fast.options()
	if err != nil {
		return err
	}
	stage, err := o.cuda.stage()
	if err != nil {
		return err
	}
	res, err := gpuckpt.GPUStep(ctx, drv, gpuckpt.GPUStepOptions{Action: action, PID: o.pid, LockTimeout: timeout,
		Pairs: pairs, FindProcs: findCUDAProcs, To: to, From: from, Open: o.loc.config(c, nil), FastPath: fast, Stage: stage,
		HostCheck: o.hostCheck, Tool: "gpucr-stream " + version, Log: c.logLine})
	if err != nil {
		return err
	}
	return printGPUStep(c, action, res)
}

// printGPUStep prints what a gpu step did.
func printGPUStep(c *cli, action string, res *gpuckpt.GPUStepResult) error {
	if c.json {
		return c.printJSON(res)
	}
	if action == "state" {
		fmt.Fprintln(c.stdout, res.State)
		return nil
	}
	if h := res.Hash; h != nil {
		d := h.Device
		fmt.Fprintf(c.stdout, "gpu hash of %d: %.2f GiB in %d blocks of %d KiB, digest %s\n", h.PID, float64(d.Bytes)/(1<<30), d.Blocks, d.Block>>10, d.Digest)
		fmt.Fprintf(c.stdout, "  on the device: kernels %.3fs (%.1f GB/s), load %.3fs, fetch %.3fs\n", d.KernelS, rate(d.Bytes, d.KernelS), d.LoadS, d.FetchS)
		fmt.Fprintf(c.stdout, "  copied out and hashed on the host: copy %.3fs (%.1f GB/s), hash %.3fs on %d cores (%.1f GB/s)\n",
			h.CopyOutS, rate(h.CopyBytes, h.CopyOutS), h.HostHashS, h.HostCores, rate(h.HostHashed, h.HostHashS))
		if d.Compared {
			fmt.Fprintf(c.stdout, "  since the last gpu hash: %.2f GiB changed, %.2f GiB not\n", float64(d.ChangedBytes)/(1<<30), float64(d.UnchangedBytes)/(1<<30))
		}
		if d.Checked {
			fmt.Fprintf(c.stdout, "  host check: %d blocks differ (%.3fs)\n", d.MismatchedBlocks, d.CheckS)
		}
	}
	fmt.Fprintf(c.stdout, "gpu %s of %d done in %.3fs\n", action, res.PID, res.Seconds)
	if res.MemoryReleasedSecs > 0 {
		fmt.Fprintf(c.stdout, "  device memory released after %.3fs, device freed after %.3fs, checkpoint committed after %.3fs\n",
			res.MemoryReleasedSecs, res.DeviceFreedSecs, res.Seconds)
	}
	for _, p := range res.Phases {
		fmt.Fprintf(c.stdout, "  %-30s %7.3fs\n", p.Name, p.Secs)
	}
	return nil
}

// rate is n bytes in s seconds, in GB/s.
func rate(n int64, s float64) float64 {
	if s <= 0 {
		return 0
	}
	return float64(n) / s / 1e9
}
