package main

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/gpucr/gpucr-stream/cudadriver"
	"github.com/gpucr/gpucr-stream/gpuckpt"
)

var gpuCommand = command{"gpu", "CUDA checkpoint steps of --pid: gpu info|state|lock|checkpoint|restore|unlock|suspend|resume (suspend --to DEST / resume --from SRC: the fast path, the process alive without device memory); gpu hash: how long finding changed device memory takes, hashed on the device and copied out and hashed on the host", "ACTION",
	[]string{"pid", "lock-timeout", "gpu-map", "to", "from", "stage-memory", "host-check", "@key", "@encode", "@s3", "@fastpath", "@report"}, runGPU}

// runGPU is `gpucr-stream gpu ACTION --pid PID`: the driver's checkpoint
// steps one at a time (gpuckpt.GPUStep). Actions: info, state, lock,
// checkpoint, restore, unlock, suspend, resume; suspend --to DEST and
// resume --from SRC take the fast path; hash measures the ways of finding
// changed device memory (vram.HashDevice).
func runGPU(ctx context.Context, cfg *config, args []string) error {
	if len(args) != 1 {
		return usagef("gpu needs one action: info, state, lock, checkpoint, restore, unlock, suspend, resume, hash")
	}
	action := args[0]
	drv, err := openDriver()
	if err != nil {
		return err
	}
	if action == "info" {
		info := gpuckpt.GPUInfo(ctx, drv)
		if cfg.jsonOut {
			return json.NewEncoder(cfg.stdout).Encode(info)
		}
		fmt.Fprintf(cfg.stdout, "CUDA driver %s (%s), process checkpoint API present\n", info.CUDAVersion, info.Library)
		for _, g := range info.GPUs {
			fmt.Fprintf(cfg.stdout, "  %s %s driver %s\n", g.UUID, g.Name, g.Driver)
		}
		return nil
	}
	if cfg.pid <= 0 {
		return usagef("gpu %s needs --pid PID", action)
	}
	timeout, err := cfg.lockTimeoutDur()
	if err != nil {
		return err
	}
	var pairs []cudadriver.GPUPair
	if cfg.gpuMap != "" {
		if pairs, err = cudadriver.ParseGPUMap(cfg.gpuMap); err != nil {
			return usagef("--gpu-map: %v", err)
		}
	}
	to, err := parseLoc("--to", cfg.to)
	if err != nil {
		return err
	}
	from, err := parseLoc("--from", cfg.from)
	if err != nil {
		return err
	}
	fast, err := cfg.fastPathOptions()
	if err != nil {
		return err
	}
	stage, err := cfg.stage()
	if err != nil {
		return err
	}
	res, err := gpuckpt.GPUStep(ctx, drv, gpuckpt.GPUStepOptions{Action: action, PID: cfg.pid, LockTimeout: timeout,
		Pairs: pairs, FindProcs: findCUDAProcs, To: to, From: from, Open: cfg.locationConfig(), FastPath: fast, Stage: stage,
		HostCheck: cfg.hostCheck, Tool: "gpucr-stream " + version, Log: cfg.logLine})
	if err != nil {
		return err
	}
	if cfg.jsonOut {
		return json.NewEncoder(cfg.stdout).Encode(res)
	}
	if action == "state" {
		fmt.Fprintln(cfg.stdout, res.State)
		return nil
	}
	if h := res.Hash; h != nil {
		d := h.Device
		fmt.Fprintf(cfg.stdout, "gpu hash of %d: %.2f GiB in %d blocks of %d KiB, digest %s\n", h.PID, float64(d.Bytes)/(1<<30), d.Blocks, d.Block>>10, d.Digest)
		fmt.Fprintf(cfg.stdout, "  on the device: kernels %.3fs (%.1f GB/s), load %.3fs, fetch %.3fs\n", d.KernelS, rate(d.Bytes, d.KernelS), d.LoadS, d.FetchS)
		fmt.Fprintf(cfg.stdout, "  copied out and hashed on the host: copy %.3fs (%.1f GB/s), hash %.3fs on %d cores (%.1f GB/s)\n",
			h.CopyOutS, rate(h.CopyBytes, h.CopyOutS), h.HostHashS, h.HostCores, rate(h.HostHashed, h.HostHashS))
		if d.Compared {
			fmt.Fprintf(cfg.stdout, "  since the last gpu hash: %.2f GiB changed, %.2f GiB not\n", float64(d.ChangedBytes)/(1<<30), float64(d.UnchangedBytes)/(1<<30))
		}
		if d.Checked {
			fmt.Fprintf(cfg.stdout, "  host check: %d blocks differ (%.3fs)\n", d.MismatchedBlocks, d.CheckS)
		}
	}
	fmt.Fprintf(cfg.stdout, "gpu %s of %d done in %.3fs\n", action, res.PID, res.Seconds)
	if res.MemoryReleasedSecs > 0 {
		fmt.Fprintf(cfg.stdout, "  device memory released after %.3fs, device freed after %.3fs, checkpoint committed after %.3fs\n",
			res.MemoryReleasedSecs, res.DeviceFreedSecs, res.Seconds)
	}
	for _, p := range res.Phases {
		fmt.Fprintf(cfg.stdout, "  %-30s %7.3fs\n", p.Name, p.Secs)
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
