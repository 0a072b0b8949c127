//go:build linux && !nocuda

package preloadctl

import (
	"fmt"
	"runtime"
	"unsafe"

	"github.com/ebitengine/purego"
)

// RunFiller is `gpucr-stream gpu fill`: it loads the library lib into
// this process and serves a restore's filler on socket fd (preload/fill.c's
// gpucr_fill) until its end. The library binds the driver at libcuda (a
// name or a path, as the loader takes it).
func RunFiller(fd int, lib, libcuda string) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	// Loaded before the driver: the library starts no control socket here.
	h, err := purego.Dlopen(lib, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return fmt.Errorf("load %s: %w", lib, err)
	}
	fill, err := purego.Dlsym(h, "gpucr_fill")
	if err != nil {
		return fmt.Errorf("%s has no gpucr_fill (an older library?): %w", lib, err)
	}
	name := append([]byte(libcuda), 0)
	r, _, _ := purego.SyscallN(fill, uintptr(fd), uintptr(unsafe.Pointer(&name[0])))
	runtime.KeepAlive(name)
	if r != 0 {
		return fmt.Errorf("filler: the library could not bind the driver %s", libcuda)
	}
	return nil
}
