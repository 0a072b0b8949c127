//go:build !linux || nocuda

package preloadctl

import "errors"

// RunFiller needs a build with CUDA support.
func RunFiller(fd int, lib, libcuda string) error {
	return errors.New("gpu fill: this gpucr-stream was built without CUDA support")
}
