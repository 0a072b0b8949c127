package location

import (
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"

	"github.com/gpucr/gpucr-stream/pipeline"
)

// ShardFiles turns --shard-fds into files; without shards it is the given
// standard stream alone.
func ShardFiles(fds []int, std *os.File) ([]*os.File, []string, error) {
	if len(fds) == 0 {
		pipeline.GrowPipe(std.Fd())
		return []*os.File{pollable(std.Fd(), std.Name(), std)}, []string{std.Name()}, nil
	}
	var files []*os.File
	var names []string
	for i, fd := range fds {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil {
			return nil, nil, fmt.Errorf("shard %d: fd %d is not open: %w", i, fd, err)
		}
		pipeline.GrowPipe(uintptr(fd))
		name := fmt.Sprintf("shard %d (fd %d)", i, fd)
		files = append(files, pollable(uintptr(fd), name, nil))
		names = append(names, name)
	}
	return files, names, nil
}

// pollable returns a file on fd that Go's poller manages when fd is a pipe
// or socket, so that closing it wakes a goroutine blocked on it (a stalled
// sender must not keep a failed restore alive). Terminals and regular
// files are left as they are: O_NONBLOCK would leak into the shell. For a
// standard stream (orig) the new file is on a duplicate of fd: a second
// *os.File owning fd 0 or 1 would close it when collected, and the number
// would then be reused under os.Stdin or os.Stdout.
func pollable(fd uintptr, name string, orig *os.File) *os.File {
	var st unix.Stat_t
	if unix.Fstat(int(fd), &st) == nil {
		if t := st.Mode & unix.S_IFMT; t == unix.S_IFIFO || t == unix.S_IFSOCK {
			own := int(fd)
			if orig != nil {
				var err error
				if own, err = unix.Dup(int(fd)); err != nil {
					return orig
				}
				unix.CloseOnExec(own)
			}
			if unix.SetNonblock(own, true) == nil {
				return os.NewFile(uintptr(own), name)
			}
			if own != int(fd) {
				unix.Close(own)
			}
		}
	}
	if orig != nil {
		return orig
	}
	return os.NewFile(fd, name)
}

// PrivateOutput makes a regular file that standard output was redirected
// to (capture > ckpt.stream, token > FILE) readable by its owner alone:
// the shell created it with the umask's mode, and it is about to hold a
// process's memory or a secret. Pipes, sockets and terminals are left as
// they are.
func PrivateOutput(f *os.File) error {
	st, err := f.Stat()
	if err != nil || !st.Mode().IsRegular() || st.Mode().Perm()&0o077 == 0 {
		return nil
	}
	if err := f.Chmod(st.Mode().Perm() &^ 0o077); err != nil {
		return fmt.Errorf("%s is readable by other users and cannot be made private (%w): it will hold secrets", f.Name(), err)
	}
	return nil
}

// EmptyInput says f, a standard input, holds nothing and never will,
// without reading from it: /dev/null, a regular file read to its end, or a
// pipe whose writers closed it with nothing in it. A pipe still open, or
// with data, is not empty (reading is then the way to know).
func EmptyInput(f *os.File) bool {
	var st unix.Stat_t
	if unix.Fstat(int(f.Fd()), &st) != nil {
		return false
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		off, err := unix.Seek(int(f.Fd()), 0, io.SeekCurrent)
		return err == nil && off >= st.Size
	case unix.S_IFCHR:
		return unix.Major(st.Rdev) == 1 && unix.Minor(st.Rdev) == 3 // /dev/null
	case unix.S_IFIFO:
		fds := []unix.PollFd{{Fd: int32(f.Fd()), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, 0)
		return err == nil && n == 1 && fds[0].Revents&unix.POLLHUP != 0 && fds[0].Revents&unix.POLLIN == 0
	}
	return false
}
