package criusock

import (
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// Under umask 000 the sockets were srwxrwxrwx: any local user could pull
// the target's memory from serve or push images into a capture. They are
// 0600 whatever the umask, and the owner still connects.
func TestSocketPrivateUnderUmask000(t *testing.T) {
	old := syscall.Umask(0)
	defer syscall.Umask(old)
	dir := shortDir(t)
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{CaptureSocket, ServeSocket} {
		path := filepath.Join(dir, name)
		l, err := listen(path)
		if err != nil {
			t.Fatal(err)
		}
		st, err := os.Lstat(path)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode()&os.ModeSocket == 0 || st.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want a socket of mode 0600", name, st.Mode())
		}
		c, err := net.Dial("unix", path)
		if err != nil {
			t.Fatalf("%s: the owner cannot connect: %v", name, err)
		}
		c.Close()
		l.Close()
		if _, err := os.Lstat(path); !os.IsNotExist(err) {
			t.Errorf("%s left behind after Close: %v", name, err)
		}
	}
}
