//go:build linux && !nocuda

package cudadriver

import (
	"fmt"
	"runtime"
	"sync"
	"time"
	"unsafe"

	"github.com/ebitengine/purego"
	"github.com/gpucr/gpucr-stream/knobs"
)

// LibraryName is the driver library dlopen looks for; $GPUCR_LIBCUDA
// overrides it (a path, for tests and unusual installs).
const LibraryName = "libcuda.so.1"

// The argument structs of the checkpoint API, laid out as in cuda.h (each
// 64 bytes; reserved fields must be zero).
type lockArgs struct {
	timeoutMs uint32
	reserved0 uint32
	reserved1 [7]uint64
}

type restoreArgs struct {
	gpuPairs      uintptr // *CUcheckpointGpuPair
	gpuPairsCount uint32
	reserved      [52 - 8]byte
	reserved1     uint64
}

type gpuPair struct {
	old, new [16]byte
}

func init() {
	// A layout mistake here would hand the driver garbage: fail loudly.
	if unsafe.Sizeof(lockArgs{}) != 64 || unsafe.Sizeof(restoreArgs{}) != 64 || unsafe.Sizeof(gpuPair{}) != 32 {
		panic("cudadriver: CUDA checkpoint argument structs are not 64 bytes")
	}
}

// libcuda is the real driver, bound at run time.
type libcuda struct {
	path    string
	version int

	cuInit, cuDriverGetVersion                  uintptr
	getState, lock, checkpoint, restore, unlock uintptr

	initOnce sync.Once
	initErr  error
}

var (
	openOnce sync.Once
	opened   *libcuda
	openErr  error
)

// Open loads the CUDA driver and binds the checkpoint API. Without a driver
// it returns an error wrapping ErrNoDriver that says what was looked for;
// with a driver older than r570 one wrapping ErrUnsupported.
func Open() (Driver, error) {
	openOnce.Do(func() { opened, openErr = openLib(libraryPath()) })
	if openErr != nil {
		return nil, openErr
	}
	return opened, nil
}

// DriverLibrary is the driver library Open loads: $GPUCR_LIBCUDA, else
// LibraryName.
func DriverLibrary() string { return libraryPath() }

func libraryPath() string {
	if p := knobs.LibCUDA.Value(); p != "" {
		return p
	}
	return LibraryName
}

// OpenLibrary loads a specific library file (tests use it to show the
// error for a missing or wrong library).
func OpenLibrary(path string) (Driver, error) { return openLib(path) }

func openLib(path string) (*libcuda, error) {
	// dlerror's message is per thread: stay on one for dlopen and it.
	runtime.LockOSThread()
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	runtime.UnlockOSThread()
	if err != nil {
		why := err.Error()
		if why == "" {
			why = "not found"
		}
		return nil, fmt.Errorf("%w: cannot load %s (%s): this host has no NVIDIA driver, or its library is not on the loader path (set GPUCR_LIBCUDA to its path)", ErrNoDriver, path, why)
	}
	l := &libcuda{path: path}
	sym := func(name string) uintptr {
		a, err := purego.Dlsym(h, name)
		if err != nil {
			return 0
		}
		return a
	}
	l.cuInit = sym("cuInit")
	l.cuDriverGetVersion = sym("cuDriverGetVersion")
	if l.cuInit == 0 || l.cuDriverGetVersion == 0 {
		return nil, fmt.Errorf("%w: %s has no cuInit/cuDriverGetVersion: not a CUDA driver library", ErrNoDriver, path)
	}
	var v int32
	if r := Result(call(l.cuDriverGetVersion, uintptr(unsafe.Pointer(&v)))); r != Success {
		return nil, &Error{Op: "get driver version", Code: r}
	}
	l.version = int(v)
	l.getState = sym("cuCheckpointProcessGetState")
	l.lock = sym("cuCheckpointProcessLock")
	l.checkpoint = sym("cuCheckpointProcessCheckpoint")
	l.restore = sym("cuCheckpointProcessRestore")
	l.unlock = sym("cuCheckpointProcessUnlock")
	if l.getState == 0 || l.lock == 0 || l.checkpoint == 0 || l.restore == 0 || l.unlock == 0 {
		return nil, fmt.Errorf("%w: the CUDA driver in %s (CUDA %s) has no process checkpoint API (cuCheckpointProcess*, driver r570 / CUDA 12.8 or newer)", ErrUnsupported, path, VersionString(l.version))
	}
	return l, nil
}

// call calls the driver's fn. Arguments may be Go pointers converted to
// uintptr (out parameters): uintptrescapes moves what they point to onto
// the heap for the call, as it does for purego.SyscallN. Without it a
// pointer to a stack variable goes stale when the stack grows on the way
// into SyscallN, and the driver's answer lands in the old stack (seen: a
// state read back as the -1 it was set to).
//
//go:uintptrescapes
func call(fn uintptr, args ...uintptr) uintptr {
	r, _, _ := purego.SyscallN(fn, args...)
	return uintptr(uint32(r))
}

// init runs cuInit(0) once; the checkpoint calls need an initialised driver
// in the calling process (no context).
func (l *libcuda) init() error {
	l.initOnce.Do(func() {
		if r := Result(call(l.cuInit, 0)); r != Success {
			l.initErr = &Error{Op: "init (cuInit)", Code: r}
		}
	})
	return l.initErr
}

func (l *libcuda) fail(op string, pid int, r uintptr) error {
	if Result(r) == Success {
		return nil
	}
	return &Error{Op: op, PID: pid, Code: Result(r)}
}

func (l *libcuda) Version() (int, error) { return l.version, nil }

// Init initialises the driver in this process (cuInit) ahead of the first
// step that needs it (see Warm).
func (l *libcuda) Init() error { return l.init() }

func (l *libcuda) State(pid int) (State, error) {
	if err := l.init(); err != nil {
		return StateFailed, err
	}
	var s int32 = -1
	r := call(l.getState, uintptr(pid), uintptr(unsafe.Pointer(&s)))
	if err := l.fail("get state", pid, r); err != nil {
		return StateFailed, err
	}
	return State(s), nil
}

func (l *libcuda) Lock(pid int, timeout time.Duration) error {
	if err := l.init(); err != nil {
		return err
	}
	var args *lockArgs
	if timeout > 0 {
		ms := timeout.Milliseconds()
		if ms < 1 {
			ms = 1
		}
		if ms > 1<<32-1 {
			ms = 1<<32 - 1
		}
		args = &lockArgs{timeoutMs: uint32(ms)}
	}
	r := call(l.lock, uintptr(pid), uintptr(unsafe.Pointer(args)))
	runtime.KeepAlive(args)
	return l.fail("lock", pid, r)
}

func (l *libcuda) Checkpoint(pid int) error {
	if err := l.init(); err != nil {
		return err
	}
	return l.fail("checkpoint", pid, call(l.checkpoint, uintptr(pid), 0))
}

func (l *libcuda) Restore(pid int, pairs []GPUPair) error {
	if err := l.init(); err != nil {
		return err
	}
	if len(pairs) == 0 {
		return l.fail("restore", pid, call(l.restore, uintptr(pid), 0))
	}
	cp := make([]gpuPair, len(pairs))
	for i, p := range pairs {
		cp[i] = gpuPair{old: p.Old, new: p.New}
	}
	var pin runtime.Pinner
	pin.Pin(&cp[0])
	defer pin.Unpin()
	args := &restoreArgs{gpuPairs: uintptr(unsafe.Pointer(&cp[0])), gpuPairsCount: uint32(len(cp))}
	r := call(l.restore, uintptr(pid), uintptr(unsafe.Pointer(args)))
	runtime.KeepAlive(args)
	runtime.KeepAlive(cp)
	if Result(r) == ErrorNotSupported || Result(r) == ErrorInvalidValue {
		return fmt.Errorf("%w: GPU remapping on restore (--gpu-map) was refused by the driver (CUDA %s): %v", ErrUnsupported, VersionString(l.version), l.fail("restore", pid, r))
	}
	return l.fail("restore", pid, r)
}

func (l *libcuda) Unlock(pid int) error {
	if err := l.init(); err != nil {
		return err
	}
	return l.fail("unlock", pid, call(l.unlock, uintptr(pid), 0))
}
