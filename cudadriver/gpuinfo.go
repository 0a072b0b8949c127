package cudadriver

import (
	"context"
	"encoding/csv"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// GPUInfo describes a GPU whose memory a checkpoint holds, for the manifest.
type GPUInfo struct {
	UUID   string
	Name   string
	Driver string // driver version as nvidia-smi prints it ("580.159.04")
	PID    int    // the process whose memory this is (0: unknown)
	Bytes  int64  // device memory that process held (0: unknown)
}

// SMI is the nvidia-smi binary GPUs asks (a variable for tests).
var SMI = "nvidia-smi"

// GPUs asks nvidia-smi which GPUs the processes pids use and how much
// memory each holds there. It must run before the checkpoint, while the
// processes still hold the GPU. Where nvidia-smi shows none of pids (it
// may see other pid numbers from inside a container), every GPU is listed
// without pid and size. No nvidia-smi: an error; callers carry on without.
func GPUs(ctx context.Context, pids []int) ([]GPUInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	gpus, err := smiQuery(ctx, "--query-gpu=uuid,name,driver_version", 3)
	if err != nil {
		return nil, err
	}
	byUUID := map[string][]string{}
	for _, g := range gpus {
		byUUID[g[0]] = g
	}
	apps, err := smiQuery(ctx, "--query-compute-apps=pid,gpu_uuid,used_memory", 3)
	if err != nil {
		apps = nil
	}
	want := map[int]bool{}
	for _, p := range pids {
		want[p] = true
	}
	var out []GPUInfo
	for _, a := range apps {
		pid, _ := strconv.Atoi(a[0])
		if !want[pid] {
			continue
		}
		g := byUUID[a[1]]
		info := GPUInfo{UUID: a[1], PID: pid}
		if g != nil {
			info.Name, info.Driver = g[1], g[2]
		}
		if mib, err := strconv.ParseInt(a[2], 10, 64); err == nil {
			info.Bytes = mib << 20
		}
		out = append(out, info)
	}
	if len(out) == 0 {
		for _, g := range gpus {
			out = append(out, GPUInfo{UUID: g[0], Name: g[1], Driver: g[2]})
		}
	}
	return out, nil
}

func smiQuery(ctx context.Context, query string, fields int) ([][]string, error) {
	b, err := exec.CommandContext(ctx, SMI, query, "--format=csv,noheader,nounits").Output()
	if err != nil {
		return nil, fmt.Errorf("nvidia-smi %s: %w", query, err)
	}
	r := csv.NewReader(strings.NewReader(string(b)))
	r.TrimLeadingSpace = true
	r.FieldsPerRecord = -1
	recs, err := r.ReadAll()
	if err != nil {
		return nil, fmt.Errorf("nvidia-smi %s: %w", query, err)
	}
	var out [][]string
	for _, rec := range recs {
		if len(rec) < fields {
			continue
		}
		for i := range rec {
			rec[i] = strings.TrimSpace(rec[i])
		}
		out = append(out, rec)
	}
	return out, nil
}

// HostGPU is a GPU of this host, as a --gpu-map target.
type HostGPU struct {
	UUID UUID
	Name string
	Free int64 // device memory free now, bytes
}

// HostGPUs asks nvidia-smi for this host's GPUs and their free memory.
func HostGPUs(ctx context.Context) ([]HostGPU, error) {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	recs, err := smiQuery(ctx, "--query-gpu=uuid,name,memory.free", 3)
	if err != nil {
		return nil, err
	}
	var out []HostGPU
	for _, r := range recs {
		u, err := ParseUUID(r[0])
		if err != nil {
			return nil, fmt.Errorf("nvidia-smi --query-gpu: %w", err)
		}
		mib, err := strconv.ParseInt(r[2], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("nvidia-smi --query-gpu: free memory of %s: %q is not a number", r[0], r[2])
		}
		out = append(out, HostGPU{UUID: u, Name: r[1], Free: mib << 20})
	}
	return out, nil
}
