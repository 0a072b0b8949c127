package location

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
		return []*os.File{pollable(std.Fd(), std.Name(), std)}, []string{std.Name()}, nil
	}
	var files []*os.File
	var names []string
	for i, fd := range fds {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil {
			return nil, nil, fmt.Errorf("shard %d: fd %d is not open: %w", i, fd, err)
		}
		streamer.GrowPipe(uintptr(fd))
		name := fmt.Sprintf("shard %d (fd %d)", i, fd)
		files = append(files, pollable(uintptr(fd), name, nil))
		names = append(names, name)
	}
	return files, names, nil
}

// pollable returns a file on fd that Go's poller manages when fd is a pipe
// or socket, so that closing it wakes a goroutine blocked on it (a stalled
// sender must not keep a failed restore alive). Terminals and regular
// files are left as they are: O_NONBLOCK would leak into the shell.
func pollable(fd uintptr, name string, orig *os.File) *os.File {
	var st unix.Stat_t
	if unix.Fstat(int(fd), &st) == nil {
		if t := st.Mode & unix.S_IFMT; t == unix.S_IFIFO || t == unix.S_IFSOCK {
			if unix.SetNonblock(int(fd), true) == nil {
				return os.NewFile(fd, name)
			}
		}
	}
	if orig != nil {
		return orig
	}
	return os.NewFile(fd, name)
}
