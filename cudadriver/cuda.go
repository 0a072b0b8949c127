// Package cudadriver is gpucr-stream's binding of the CUDA driver: its process
// checkpoint API (lock, checkpoint, restore, unlock, state, one process at a
// time), finding the CUDA processes of a process tree, and GPU details from
// nvidia-smi for the manifest and --gpu-map. What to do with a tree, in
// which order, and what to undo when a step fails is package gpuckpt's.
//
// The driver is bound at run time (libcuda.so.1 through purego, no cgo), so
// the one binary runs on hosts without a GPU and reports plainly that there
// is no driver. Everything that calls the driver goes through the Driver
// interface, so that the policy above it is tested with a fake
// (cudadriver/drivertest).
package cudadriver

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// State is a CUDA process's checkpoint state (CUprocessState).
type State int

// The states, as the driver numbers them.
const (
	StateRunning      State = 0 // CU_PROCESS_STATE_RUNNING
	StateLocked       State = 1 // CU_PROCESS_STATE_LOCKED: CUDA calls block
	StateCheckpointed State = 2 // CU_PROCESS_STATE_CHECKPOINTED: device memory in host memory, GPU released
	StateFailed       State = 3 // CU_PROCESS_STATE_FAILED
)

func (s State) String() string {
	switch s {
	case StateRunning:
		return "running"
	case StateLocked:
		return "locked"
	case StateCheckpointed:
		return "checkpointed"
	case StateFailed:
		return "failed"
	}
	return "state(" + strconv.Itoa(int(s)) + ")"
}

// Result is a CUDA driver API result code (CUresult).
type Result int

// The results the checkpoint API and its setup return, and a few more that
// a broken setup produces.
const (
	Success                Result = 0
	ErrorInvalidValue      Result = 1
	ErrorOutOfMemory       Result = 2
	ErrorNotInitialized    Result = 3
	ErrorDeinitialized     Result = 4
	ErrorStubLibrary       Result = 34
	ErrorInsufficientDrv   Result = 35
	ErrorDeviceUnavailable Result = 46
	ErrorNoDevice          Result = 100
	ErrorInvalidDevice     Result = 101
	ErrorOperatingSystem   Result = 304
	ErrorInvalidHandle     Result = 400
	ErrorIllegalState      Result = 401
	ErrorNotFound          Result = 500
	ErrorNotReady          Result = 600
	ErrorNotPermitted      Result = 800
	ErrorNotSupported      Result = 801
	ErrorSystemNotReady    Result = 802
	ErrorSystemDrvMismatch Result = 803
	ErrorTimeout           Result = 909
	ErrorUnknown           Result = 999
)

var resultNames = map[Result]string{
	Success:                "CUDA_SUCCESS",
	ErrorInvalidValue:      "CUDA_ERROR_INVALID_VALUE",
	ErrorOutOfMemory:       "CUDA_ERROR_OUT_OF_MEMORY",
	ErrorNotInitialized:    "CUDA_ERROR_NOT_INITIALIZED",
	ErrorDeinitialized:     "CUDA_ERROR_DEINITIALIZED",
	ErrorStubLibrary:       "CUDA_ERROR_STUB_LIBRARY",
	ErrorInsufficientDrv:   "CUDA_ERROR_INSUFFICIENT_DRIVER",
	ErrorDeviceUnavailable: "CUDA_ERROR_DEVICE_UNAVAILABLE",
	ErrorNoDevice:          "CUDA_ERROR_NO_DEVICE",
	ErrorInvalidDevice:     "CUDA_ERROR_INVALID_DEVICE",
	ErrorOperatingSystem:   "CUDA_ERROR_OPERATING_SYSTEM",
	ErrorInvalidHandle:     "CUDA_ERROR_INVALID_HANDLE",
	ErrorIllegalState:      "CUDA_ERROR_ILLEGAL_STATE",
	ErrorNotFound:          "CUDA_ERROR_NOT_FOUND",
	ErrorNotReady:          "CUDA_ERROR_NOT_READY",
	ErrorNotPermitted:      "CUDA_ERROR_NOT_PERMITTED",
	ErrorNotSupported:      "CUDA_ERROR_NOT_SUPPORTED",
	ErrorSystemNotReady:    "CUDA_ERROR_SYSTEM_NOT_READY",
	ErrorSystemDrvMismatch: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
	ErrorTimeout:           "CUDA_ERROR_TIMEOUT",
	ErrorUnknown:           "CUDA_ERROR_UNKNOWN",
}

func (r Result) String() string {
	if n, ok := resultNames[r]; ok {
		return n
	}
	return "CUresult(" + strconv.Itoa(int(r)) + ")"
}

// Error is a failed driver call.
type Error struct {
	Op   string // "lock", "checkpoint", "restore", "unlock", "get state", "init"
	PID  int    // 0 for calls about no process
	Code Result
}

func (e *Error) Error() string {
	hint := ""
	switch e.Code {
	case ErrorTimeout:
		hint = " (the process did not reach a point where it could be locked in time: raise --lock-timeout)"
	case ErrorNotSupported:
		hint = " (this driver or GPU does not support it)"
	case ErrorIllegalState:
		hint = " (the process is not in the state this step needs)"
	case ErrorNotInitialized, ErrorInvalidValue:
		if e.PID > 0 {
			hint = " (is it a CUDA process that finished cuInit?)"
		}
	}
	if e.PID > 0 {
		return fmt.Sprintf("cuda %s of pid %d: %s%s", e.Op, e.PID, e.Code, hint)
	}
	return fmt.Sprintf("cuda %s: %s%s", e.Op, e.Code, hint)
}

// ErrNoDriver means libcuda.so.1 (or the checkpoint API in it) is not there.
var ErrNoDriver = errors.New("no CUDA driver")

// ErrUnsupported means the driver is there but lacks what was asked for.
var ErrUnsupported = errors.New("not supported by this CUDA driver")

// UUID is a GPU's 16-byte identity (CUuuid), printed as nvidia-smi does:
// GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
type UUID [16]byte

func (u UUID) String() string {
	const hex = "0123456789abcdef"
	b := []byte("GPU-")
	for i, c := range u {
		if i == 4 || i == 6 || i == 8 || i == 10 {
			b = append(b, '-')
		}
		b = append(b, hex[c>>4], hex[c&15])
	}
	return string(b)
}

// ParseUUID reads a GPU UUID with or without the "GPU-" prefix and dashes.
func ParseUUID(s string) (UUID, error) {
	var u UUID
	h := s
	if len(h) >= 4 && (h[:4] == "GPU-" || h[:4] == "gpu-") {
		h = h[4:]
	}
	n := 0
	for i := 0; i < len(h); i++ {
		c := h[i]
		if c == '-' {
			continue
		}
		var v byte
		switch {
		case c >= '0' && c <= '9':
			v = c - '0'
		case c >= 'a' && c <= 'f':
			v = c - 'a' + 10
		case c >= 'A' && c <= 'F':
			v = c - 'A' + 10
		default:
			return u, fmt.Errorf("GPU UUID %q: %q is not a hex digit", s, c)
		}
		if n >= 32 {
			return u, fmt.Errorf("GPU UUID %q: more than 32 hex digits", s)
		}
		if n%2 == 0 {
			u[n/2] = v << 4
		} else {
			u[n/2] |= v
		}
		n++
	}
	if n != 32 {
		return u, fmt.Errorf("GPU UUID %q: %d hex digits, want 32", s, n)
	}
	return u, nil
}

// GPUPair maps a GPU of the checkpoint to a GPU of this host on restore.
type GPUPair struct {
	Old, New UUID
}

// ParseGPUMap reads "OLD=NEW[,OLD=NEW...]".
func ParseGPUMap(s string) ([]GPUPair, error) {
	if s == "" {
		return nil, nil
	}
	var out []GPUPair
	start := 0
	for i := 0; i <= len(s); i++ {
		if i < len(s) && s[i] != ',' {
			continue
		}
		item := s[start:i]
		start = i + 1
		eq := -1
		for j := 0; j < len(item); j++ {
			if item[j] == '=' {
				eq = j
				break
			}
		}
		if eq < 0 {
			return nil, fmt.Errorf("gpu map %q: want OLD_UUID=NEW_UUID", item)
		}
		o, err := ParseUUID(item[:eq])
		if err != nil {
			return nil, err
		}
		n, err := ParseUUID(item[eq+1:])
		if err != nil {
			return nil, err
		}
		out = append(out, GPUPair{o, n})
	}
	return out, nil
}

// FormatGPUMap writes pairs as ParseGPUMap reads them.
func FormatGPUMap(pairs []GPUPair) string {
	var b strings.Builder
	for i, p := range pairs {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(p.Old.String() + "=" + p.New.String())
	}
	return b.String()
}

// Driver is the CUDA driver's process checkpoint API. Every call names
// the target process; the calling process needs no CUDA context of its own.
type Driver interface {
	// Version is cuDriverGetVersion: 1000*major + 10*minor (13000 = CUDA 13.0).
	Version() (int, error)
	State(pid int) (State, error)
	// Lock blocks further CUDA calls of pid and waits (up to timeout, 0 =
	// the driver's default) for the work it has in flight.
	Lock(pid int, timeout time.Duration) error
	// Checkpoint copies pid's device memory into its host memory and
	// releases the GPU; pid must be locked.
	Checkpoint(pid int) error
	// Restore brings pid's device memory back (onto other GPUs where pairs
	// map them); pid must be checkpointed.
	Restore(pid int, pairs []GPUPair) error
	// Unlock lets pid's CUDA calls run again.
	Unlock(pid int) error
}

// VersionString prints a driver API version as "13.0".
func VersionString(v int) string {
	return fmt.Sprintf("%d.%d", v/1000, v%1000/10)
}
