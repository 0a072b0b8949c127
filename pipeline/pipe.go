package pipeline

import "golang.org/x/sys/unix"

// PipeSize is what stream pipes are grown to: with the default 64 KiB a
// multi-GiB stream costs tens of thousands of wakeups per GiB.
const PipeSize = 4 << 20

// GrowPipe enlarges a pipe's buffer as far as the system allows; it does
// nothing to files and sockets.
func GrowPipe(fd uintptr) {
	var st unix.Stat_t
	if unix.Fstat(int(fd), &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFIFO {
		return
	}
	for size := PipeSize; size >= 64<<10; size /= 2 {
		if _, err := unix.FcntlInt(fd, unix.F_SETPIPE_SZ, size); err == nil {
			return
		}
	}
}
