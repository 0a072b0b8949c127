package proc

import (
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestMappedFilesAndSockets maps an unlinked file and holds an abstract
// unix socket in this process, and finds both by name.
func TestMappedFilesAndSockets(t *testing.T) {
	path := filepath.Join(t.TempDir(), "mapped file")
	if err := os.WriteFile(path, make([]byte, 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	mem, err := syscall.Mmap(int(f.Fd()), 0, 4096, syscall.PROT_READ, syscall.MAP_SHARED)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(mem)
	os.Remove(path)
	self := os.Getpid()
	if got := MappedFiles(self); !slices.Contains(got, path) {
		t.Errorf("MappedFiles lacks the unlinked %q: %q", path, got)
	}
	name := "@gpucr-proc-test-" + strconv.Itoa(self)
	ln, err := net.Listen("unix", name)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if got := UnixSocketNames(self); !slices.Contains(got, name) {
		t.Errorf("UnixSocketNames lacks %q: %q", name, got)
	}
	// NCCL pads its abstract names with NULs to the whole sun_path; the
	// kernel lists them as '@'.
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fd)
	padded := name + "-padded"
	if err := syscall.Bind(fd, &syscall.SockaddrUnix{Name: padded + strings.Repeat("\x00", 107-len(padded))}); err != nil {
		t.Fatal(err)
	}
	if got := UnixSocketNames(self); !slices.Contains(got, padded) {
		t.Errorf("UnixSocketNames lacks %q without its padding: %q", padded, got)
	}
	if got := ThreadNames(self); len(got) == 0 || got[0] == "" {
		t.Errorf("ThreadNames: %q", got)
	}
	if MappedFiles(1<<30) != nil || UnixSocketNames(1<<30) != nil {
		t.Error("a process that is not there has files")
	}
}
