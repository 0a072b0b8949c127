package criusock

// The streamer sockets live in the images dir, whose path may be longer
// than sun_path holds (Podman's .../userdata/checkpoint is about 150
// bytes). They are bound and reached through a descriptor of the
// directory: /proc/self/fd/N/NAME is short whatever the directory's path,
// as CRIU's own RPC side does with /proc/PID/fd/N.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
)

// MaxSocketPath is the size of sun_path: a socket's path must be shorter.
const MaxSocketPath = 108

// dirListener is a streamer socket bound in a directory held open by a
// descriptor; Close removes the socket file through that descriptor.
type dirListener struct {
	*net.UnixListener
	dir    *os.File
	name   string
	closed sync.Once
}

// Close stops listening and removes the socket file, once.
func (l *dirListener) Close() error {
	err := l.UnixListener.Close()
	l.closed.Do(func() {
		_ = unix.Unlinkat(int(l.dir.Fd()), l.name, 0)
		l.dir.Close()
	})
	return err
}

// openDir opens dir for use as the base of socket paths.
func openDir(dir string) (*os.File, error) {
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", dir, err)
	}
	return os.NewFile(uintptr(fd), dir), nil
}

// viaFD is the short path of name in the directory open as d.
func viaFD(d *os.File, name string) string {
	return "/proc/self/fd/" + strconv.Itoa(int(d.Fd())) + "/" + name
}

// listen binds a fresh socket named name in dir, removing a stale one
// first. The socket is 0600 whatever the umask: whoever can connect can
// read the process's memory (serve) or push images into its checkpoint
// (capture). CRIU (root) and producers (the same user) still can. The mode
// is set on the socket before bind, which creates the file with it, so
// there is no moment when the file is open to others.
func listen(dir, name string) (*dirListener, error) {
	path := filepath.Join(dir, name)
	d, err := openDir(dir)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	l, err := bindIn(d, name, path)
	if err != nil {
		d.Close()
		return nil, err
	}
	return &dirListener{UnixListener: l, dir: d, name: name}, nil
}

func bindIn(d *os.File, name, path string) (*net.UnixListener, error) {
	dfd := int(d.Fd())
	if err := unix.Unlinkat(dfd, name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return nil, fmt.Errorf("remove stale socket %s: %w", path, err)
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close() // FileListener holds its own descriptor
	if err := unix.Fchmod(fd, 0o600); err != nil {
		return nil, fmt.Errorf("listen on %s: set mode: %w", path, err)
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: viaFD(d, name)}); err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	// Checked, not assumed: a kernel that ignored the mode set before bind
	// must not leave an open socket behind.
	var st unix.Stat_t
	if err := unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil || st.Mode&0o077 != 0 {
		_ = unix.Unlinkat(dfd, name, 0)
		if err == nil {
			err = fmt.Errorf("mode %o", st.Mode&0o777)
		}
		return nil, fmt.Errorf("listen on %s: the socket is not private: %w", path, err)
	}
	if err := unix.Listen(fd, unix.SOMAXCONN); err != nil {
		_ = unix.Unlinkat(dfd, name, 0)
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	nl, err := net.FileListener(f)
	if err != nil {
		_ = unix.Unlinkat(dfd, name, 0)
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	l := nl.(*net.UnixListener)
	l.SetUnlinkOnClose(false) // Close unlinks through the directory
	return l, nil
}

// dialIn connects to the socket named name in dir, whatever the length of
// dir's path.
func dialIn(ctx context.Context, dir, name string) (*net.UnixConn, error) {
	path := filepath.Join(dir, name)
	d, err := openDir(dir)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", path, err)
	}
	defer d.Close() // the connection does not need the path afterwards
	var dl net.Dialer
	c, err := dl.DialContext(ctx, "unix", viaFD(d, name))
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", path, err)
	}
	return c.(*net.UnixConn), nil
}

// ReachableDir is a path of dir through which CRIU, run by this process,
// reaches the streamer sockets in it: dir itself when its socket paths
// fit sun_path, else /proc/PID/fd/N of a descriptor of dir held until
// release is called (CRIU joins "DIR/streamer-*.sock" and cuts it at
// sun_path's size).
func ReachableDir(dir string) (path string, release func(), err error) {
	longest := filepath.Join(dir, CaptureSocket)
	if s := filepath.Join(dir, ServeSocket); len(s) > len(longest) {
		longest = s
	}
	if len(longest) < MaxSocketPath {
		return dir, func() {}, nil
	}
	d, err := openDir(dir)
	if err != nil {
		return "", nil, err
	}
	return "/proc/" + strconv.Itoa(os.Getpid()) + "/fd/" + strconv.Itoa(int(d.Fd())), func() { d.Close() }, nil
}
