//go:build !linux || nocuda

package cudadriver

import "fmt"

// LibraryName is the driver library a build with CUDA support loads.
const LibraryName = "libcuda.so.1"

// Open reports that this build has no CUDA support: it was built with the
// nocuda tag (a fully static binary) or for a system other than Linux.
func Open() (Driver, error) {
	return nil, fmt.Errorf("%w: this gpucr-stream was built without CUDA support (build tag nocuda or not Linux)", ErrNoDriver)
}

// OpenLibrary is Open in a build without CUDA support.
func OpenLibrary(path string) (Driver, error) { return Open() }

// DriverLibrary is the driver library a build with CUDA support loads.
func DriverLibrary() string { return LibraryName }
