package sinks

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/streamer"
)

// ShardFiles turns --shard-fds into files; without shards it is the given
// standard stream alone.
func ShardFiles(fds []int, std *os.File) ([]*os.File, []string, error) {
	if len(fds) == 0 {
		streamer.GrowPipe(std.Fd())
		return []*os.File{std}, []string{std.Name()}, nil
	}
	var files []*os.File
	var names []string
	for i, fd := range fds {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil {
			return nil, nil, fmt.Errorf("shard %d: fd %d is not open: %w", i, fd, err)
		}
		streamer.GrowPipe(uintptr(fd))
		name := fmt.Sprintf("shard %d (fd %d)", i, fd)
		files = append(files, os.NewFile(uintptr(fd), name))
		names = append(names, name)
	}
	return files, names, nil
}
